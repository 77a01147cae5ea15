"""Gaps found by a hand-made mutation sweep of the last session's code
(c6ee1bc..00ee8e9): external CUDA streams keyed by wrapper, the agreement's
thread-local buffers, the wake-ups' forgotten bounce counts,
``forget_stream``, the ``unfittable`` count, ``PoolCollector``'s lock,
``log_force_release_many(remembers_fault=)`` and the page ring built from
numpy's bytes.

Each test pins one behaviour that a mutant broke while every test file that
exercises the code still passed (61 mutants: 42 killed by the existing
tests, 6 equivalent, 13 gaps: these tests; see docs/changes.md):

* the default stream (handle 0, ``stream_id`` 0) is PyTorch's own, keyed
  by (device, handle): its fences stay ordered across new wrappers; one
  handle on two devices is two streams;
* the all-reduce's reused pair is a host buffer and its copy on the
  group's device (the same tensor on the CPU);
* ``forget_stream`` refuses while pages alone wait behind the stream,
  every ledger left as it was; its refusal says how many batches wait;
  an ``AsyncReqToTokenPool``'s and its page pool's are refused off the
  pool's thread;
* ``PoolCollector``: its pools and its counters' last values are walked,
  popped and written under its lock (``add``, ``remove``, ``describe``,
  ``collect`` and its clean-up); two adds of one pool under two names at
  once: one is refused;
* a grouped ``admit`` counts as unfittable past a group asked exactly its
  capacity, and not when the first count refused is not an integer;
  ``check_invariants`` checks ``unfittable`` against its priorities;
* ``log_force_release_many`` asks ``remembers_fault`` only when nothing
  came back and nothing is held.

No GPU here: CUDA streams are stand-ins with what ``_record_cuda`` reads,
the group's device is ``meta`` under a stand-in all-reduce. Async tests run
on asyncio and uvloop (conftest); every wait is bounded.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from helpers import (
    WAIT_S,
    EventFence,
    FakeStream,
    StandInEvent,
    bounded,
    forget_stand_in_events,
    grouped_pool,
    in_thread,
)
from test_collector_threads import _both, _meet, _SlowLookup

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    KVPagePool,
    ReqToTokenPool,
    WrongThreadError,
)
from asyncpool import agreement as agreement_mod
from asyncpool import base as base_mod
from asyncpool import fences as fences_mod
from asyncpool.metrics import PoolCollector

# -- CUDA stream keys ------------------------------------------------------------


class _Device:
    def __init__(self, index: int) -> None:
        self.index = index


class _Stream:
    """What ``_record_cuda`` reads of a ``torch.cuda.Stream`` (a new wrapper
    each time, as ``torch.cuda.current_stream()`` makes): ``external``, an
    ``ExternalStream``, whose ``stream_id`` is its handle; else one of
    PyTorch's own, whose ``stream_id`` is a small packed index (0 for the
    default stream, whose handle is 0 too)."""

    def __init__(self, handle: int, device: int, *, external: bool = False) -> None:
        self.device = _Device(device)
        self.cuda_stream = handle
        self.stream_id = handle if external else (2 * (handle % 32) + 1 if handle else 0)


class _Event(StandInEvent):
    def record(self, stream: object) -> None:
        pass


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The pool's events: stand-ins, never completed (nothing waits on them)."""
    monkeypatch.setattr(
        fences_mod._event_pool, "take", lambda device_index: _Event(threading.Event(), WAIT_S)
    )
    yield
    gc.collect()
    forget_stand_in_events()


def _record(stream: _Stream) -> fences_mod.CudaFence:
    return fences_mod._record_cuda(cast(Any, stream))


def test_the_default_stream_keeps_one_key_whatever_wraps_it(events: None) -> None:
    """The default stream (handle 0, ``stream_id`` 0) is PyTorch's own, not
    an external stream: keyed by (device, handle), so its fences stay
    ordered across the new wrapper each ``current_stream()`` returns (the
    mutant took it for external, a key per wrapper: no fence of it stood
    for an older one)."""
    a = _record(_Stream(0, -5))
    b = _record(_Stream(0, -5))
    assert b.stream_key == a.stream_key and b.seq == a.seq + 1


def test_one_handle_on_two_devices_is_two_streams(events: None) -> None:
    """Each device has a default stream of handle 0: the same handle on two
    devices is two streams, two keys (the mutant keyed by handle alone, so
    device 1's fence passed for a later point of device 0's stream)."""
    on_a = _record(_Stream(0, -6))
    on_b = _record(_Stream(0, -7))
    assert on_a.stream_key != on_b.stream_key
    native_a = _record(_Stream(0x7F00_0000_5000, -6))
    native_b = _record(_Stream(0x7F00_0000_5000, -7))
    assert native_a.stream_key != native_b.stream_key


# -- the agreement's buffers ---------------------------------------------------


class _Stop(Exception):
    """Raised by the stand-in all-reduce once it has seen its tensor."""


def test_the_all_reduce_buffer_is_on_the_groups_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reused pair is a host buffer and its copy on the group's device
    (NCCL reduces device tensors only); on the CPU the two are one. The
    mutant handed the host buffer to every backend. ``meta`` stands in for
    a CUDA device: the stand-in all-reduce reads its tensor's device."""
    seen: list[torch.device] = []

    def all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        seen.append(t.device)
        raise _Stop

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    # This thread's buffers of its own, dropped after: the pairs kept here
    # (a meta one among them) are not left for a later test that counts
    # what the thread keeps (test_mutation_sweep_agreement's).
    monkeypatch.setattr(agreement_mod, "_buffers", agreement_mod._ThreadBuffers())
    for device in ("meta", "cpu"):
        with pytest.raises(_Stop):
            agreement_mod._all_reduce_min([4, 2], None, torch.device(device))
    assert [d.type for d in seen] == ["meta", "cpu"]
    kept = agreement_mod._buffers.by_shape
    assert kept[("meta", 2)][1].device.type == "meta"
    assert kept[("cpu", 2)][0] is kept[("cpu", 2)][1]


# -- forget_stream ----------------------------------------------------------------


def test_forget_stream_refuses_while_only_the_pages_wait() -> None:
    """Pages freed behind a fence of the stream (no row): the refusal asks
    every ledger of the call, and changes none (the mutant asked the rows
    only, and dropped both marks with pages still waiting)."""
    kv = KVPagePool(16, 4, reclaim="explicit")
    pool = AsyncReqToTokenPool(8, 4, kv=kv, reclaim="explicit")
    stream = FakeStream()
    first = stream.record()
    assert pool.retire(first) == (0, 0)
    pages = kv.alloc(2)
    assert pages is not None
    kv.free(pages, fence=stream.record())
    marks = (dict(pool._ledger._retired), dict(kv._ledger._retired))
    with pytest.raises(RuntimeError, match="1 batch"):
        pool.forget_stream(stream.key)
    assert (dict(pool._ledger._retired), dict(kv._ledger._retired)) == marks
    assert kv.pending_size() == 2


def test_forget_stream_says_how_many_batches_wait() -> None:
    """The refusal counts the batches behind the stream's fences (two
    frees, two batches), not whether there are some."""
    pool = ReqToTokenPool(8, 4, reclaim="explicit")
    stream = FakeStream()
    for _ in range(2):
        row = pool.alloc(1)
        assert row is not None
        pool.free(row, fence=stream.record())
    with pytest.raises(RuntimeError, match=r"\b2 batch\(es\) still wait"):
        pool.forget_stream(stream.key)
    assert pool.pending_size() == 2


async def test_forget_stream_is_refused_off_the_pools_thread() -> None:
    """``AsyncReqToTokenPool.forget_stream`` and its page pool's are loop
    thread only, as ``retire``: another thread is refused, every mark kept
    (the mutants dropped the thread check, of either)."""
    async with bounded():
        kv = KVPagePool(16, 4, reclaim="explicit")
        pool = AsyncReqToTokenPool(8, 4, kv=kv, reclaim="explicit")
        stream = FakeStream()
        pool.bind()
        pool.retire(stream.record())
        for call in (pool.forget_stream, kv.forget_stream):
            with pytest.raises(WrongThreadError):
                in_thread(functools.partial(call, stream.key))
        assert pool._ledger._retired and kv._ledger._retired
        assert pool.forget_stream(stream.key) is True


# -- PoolCollector's lock ---------------------------------------------------------


class _LockedOnly(dict):  # type: ignore[type-arg]
    """One of the collector's dicts whose walks, pops and writes assert that
    the collector's lock is held (a membership test may run without it:
    ``add``'s early check)."""

    def __init__(self, lock: Any) -> None:
        super().__init__()
        self._lock = lock

    def _held(self) -> None:
        # Held by this thread: an RLock (the collector's, reentrant) answers
        # _is_owned(), as threading.Condition asks it; a Lock only locked().
        owned = getattr(self._lock, "_is_owned", None)
        held = owned() if owned is not None else self._lock.locked()
        assert held, "the collector's state was walked without its lock"

    def __iter__(self) -> Any:
        self._held()
        return super().__iter__()

    def items(self) -> Any:
        self._held()
        return super().items()

    def values(self) -> Any:
        self._held()
        return super().values()

    def get(self, *args: Any) -> Any:
        self._held()
        return super().get(*args)

    def pop(self, *args: Any) -> Any:
        self._held()
        return super().pop(*args)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._held()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._held()
        super().__delitem__(key)


def test_the_collector_walks_its_pools_and_last_values_under_its_lock() -> None:
    """``add``'s checks and insert, ``remove``'s pop and forget, ``describe``'s
    and ``collect``'s copies, a scrape's clean-up of a pool removed under it
    and each counter's last value: all under the collector's lock (a walk
    of a dict another thread's ``add`` grows raises, a forget walking
    ``_last`` while a scrape writes it too). The mutants dropped the lock
    of one of them."""
    collector = PoolCollector()
    collector._pools = _LockedOnly(collector._lock)
    collector._last = _LockedOnly(collector._lock)
    kept, gone = AsyncReqToTokenPool(3, 4), AsyncReqToTokenPool(3, 4)
    collector.add(kept, "kept")
    collector.add(gone, "gone")
    assert any(m.name.endswith("alloc_calls") for m in collector.describe())
    scrape = collector.collect()
    next(scrape)  # begun: its copy of the pools taken
    collector.remove("gone")  # forgets what it wrote so far; it writes more
    assert [m.name for m in scrape]
    with collector._lock:  # only the pool still exported has last values
        assert {key[1] for key in collector._last} == {collector._pools["kept"][1]}
    collector.remove("kept")
    assert not collector._last
    assert collector.names == ()


class _SlowInsert(dict):  # type: ignore[type-arg]
    """A collector's pools whose insert waits for the other adder first."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self._barrier = barrier

    def __setitem__(self, key: Any, value: Any) -> None:
        _meet(self._barrier)
        super().__setitem__(key, value)


def test_two_threads_adding_one_pool_under_two_names_at_once_one_is_refused() -> None:
    """The check that a pool is not exported already runs with the insert,
    under the lock: two adds of one pool at once, under two names, cannot
    both pass (its figures would count twice in every sum over pools). The
    adders meet before their checks, and the first insert waits for the
    other: made before the lock, the other's check passed too."""
    pool = _SlowLookup(threading.Barrier(2))
    collector = PoolCollector()
    collector._pools = _SlowInsert(threading.Barrier(2))
    errors = _both(lambda: collector.add(pool, "a"), lambda: collector.add(pool, "b"))
    refused = [e for e in errors if e is not None]
    assert len(refused) == 1, f"both adds of one pool passed: {errors}"
    assert isinstance(refused[0], ValueError) and "exported once" in str(refused[0])
    assert len(collector.names) == 1


# -- the unfittable count ------------------------------------------------------------


async def test_a_grouped_admit_is_counted_past_a_group_filled_exactly() -> None:
    """A group asked exactly its capacity is not what made the call
    unfittable: the count goes on to the group past its capacity (the
    mutant stopped at the first, and counted nothing)."""
    async with bounded():
        pool = grouped_pool()  # swa 8 pages, full 12
        with pytest.raises(CapacityError, match="'full'"):
            await pool.admit(pages={"swa": 8, "full": 13}, priority=1)
        assert pool.stats().unfittable == 1
        assert pool.stats().by_priority[1].unfittable == 1
        pool.check_invariants()


async def test_a_grouped_admit_refused_for_a_bad_count_first_is_not_counted() -> None:
    """The first count refused, in the groups' order, is not an integer:
    bad input, counted nowhere, whatever a later group asks (the mutant
    went on to the later group and counted the call unfittable)."""
    async with bounded():
        pool = grouped_pool()
        with pytest.raises(CapacityError, match="must be an integer"):
            await pool.admit(pages=cast(Any, {"swa": "8", "full": 13}))
        assert pool.stats().unfittable == 0
        pool.check_invariants()


async def test_check_invariants_checks_the_unfittable_count_against_the_priorities() -> None:
    """``unfittable`` is the sum over the priorities, as the other refusal
    counts: ``check_invariants`` says so when they disagree (the mutant
    left ``unfittable`` out of the check)."""
    async with bounded():
        pool = AsyncReqToTokenPool(3, 4)
        with pytest.raises(CapacityError):
            await pool.alloc(5, priority=1)
        pool.check_invariants()
        pool._waiters.unfittable += 1
        with pytest.raises(AssertionError, match="unfittable: 2 in all, 1 summed"):
            pool.check_invariants()


# -- force_release's line for several fences -------------------------------------------


def test_force_release_many_asks_of_faults_only_when_nothing_came_back_nor_is_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``remembers_fault`` is asked of each fence only when nothing came
    back and nothing is held: the line says what came back, or that the
    memory still waits, without the fault look-ups (the mutant asked of
    every fence on every call)."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    fences = [EventFence(), EventFence()]
    asked: list[Any] = []

    def remembers_fault(fence: Any) -> bool:
        asked.append(fence)
        return fence is fences[0]

    log = logging.getLogger("asyncpool.pool")
    base_mod.log_force_release_many(log, fences, 2, None, False, remembers_fault=remembers_fault)
    base_mod.log_force_release_many(log, fences, 0, 0, True, remembers_fault=remembers_fault)
    assert asked == []
    base_mod.log_force_release_many(log, fences, 0, None, False, remembers_fault=remembers_fault)
    assert asked == fences
    assert "1 of these fences faulted; the rows behind it are quarantined" in caplog.text
