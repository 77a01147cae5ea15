"""Bookkeeping that must not only grow, nor outlive its owner (a soak's four
findings): the CUDA stream keys of external streams, whose handles come and
go and are reused; the agreement's reused all-reduce buffers, per thread;
the explicit ledgers' retired marks, one per stream key; the wake-ups'
bounce counts once the watcher is gone.

No GPU here: the CUDA streams are stand-ins with what ``_record_cuda``
reads (``device.index``, ``cuda_stream``, ``stream_id``), their events
:class:`helpers.StandInEvent` gated by the test.
"""

from __future__ import annotations

import asyncio
import gc
import re
import threading
import tracemalloc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from helpers import (
    FAKE_DEVICE,
    WAIT_S,
    EventFence,
    FakeStream,
    StandInEvent,
    forget_stand_in_events,
)
from test_mutation_sweep_recent import _Ledger, _Timers, _Watcher, _with_ledger

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool
from asyncpool import agreement as agreement_mod
from asyncpool import fences as fences_mod
from asyncpool.deferral import newest_per_stream

# -- CUDA stream keys ----------------------------------------------------------


class _Device:
    index = FAKE_DEVICE


class _FakeStream:
    """What ``_record_cuda`` reads of a ``torch.cuda.Stream``. ``external``:
    an ``ExternalStream``, whose ``stream_id`` is its handle; else one of
    PyTorch's own, whose ``stream_id`` is a small packed index."""

    device = _Device()

    def __init__(self, handle: int, *, external: bool) -> None:
        self.cuda_stream = handle
        self.stream_id = handle if external else 2 * (handle % 32) + 1


class _Event(StandInEvent):
    def record(self, stream: object) -> None:
        pass


@pytest.fixture
def gates(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[threading.Event]]:
    """Each event the pool hands out is gated by a new event, appended here."""
    made: list[threading.Event] = []

    def take(device_index: int) -> _Event:
        made.append(threading.Event())
        return _Event(made[-1], WAIT_S)

    monkeypatch.setattr(fences_mod._event_pool, "take", take)
    yield made
    gc.collect()
    forget_stand_in_events()


def _record(stream: _FakeStream) -> fences_mod.CudaFence:
    return fences_mod._record_cuda(cast(Any, stream))


def test_a_reused_external_handle_is_a_new_stream_not_a_later_point_of_the_old(
    gates: list[threading.Event],
) -> None:
    """An external stream is destroyed with its fence (seq 5) still open, and
    a new stream is given the same handle value. Keyed by handle, the new
    stream's fence was seq 6 of the same key: once it completed, the pool
    took the old fence for done (the newest of a stream stands for every
    older one) and handed out the rows still being written."""
    old = _FakeStream(0x7F00_0000_1000, external=True)
    for _ in range(4):
        _record(old)
    open_fence = _record(old)
    del old  # the stream is destroyed, its work still queued
    gc.collect()
    new = _FakeStream(0x7F00_0000_1000, external=True)
    later = _record(new)
    assert later.stream_key != open_fence.stream_key
    assert newest_per_stream([open_fence, later]) == [open_fence, later]

    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows, fence=[open_fence, later])
    gates[-1].set()  # the new stream's fence completes, the old one's not
    assert pool.reclaim() == 0 and pool.pending_size() == 2
    gates[-2].set()
    assert pool.reclaim() == 2


def test_one_external_wrapper_keeps_its_fences_ordered(
    gates: list[threading.Event],
) -> None:
    """A wrapper kept for the stream's life orders its fences as before, and
    PyTorch's own streams are keyed by handle whatever wraps them (a
    ``torch.Stream`` turned into a new ``torch.cuda.Stream`` each record)."""
    ext = _FakeStream(0x7F00_0000_2000, external=True)
    a, b = _record(ext), _record(ext)
    assert a.stream_key == b.stream_key and b.seq == a.seq + 1
    c = _record(_FakeStream(0x7F00_0000_3000, external=False))
    d = _record(_FakeStream(0x7F00_0000_3000, external=False))
    assert c.stream_key == d.stream_key and d.seq == c.seq + 1
    default = _record(_FakeStream(0, external=False))  # stream_id 0 == handle 0
    assert default.stream_key not in (a.stream_key, c.stream_key)


def test_external_streams_that_come_and_go_leave_no_keys_behind(
    gates: list[threading.Event],
) -> None:
    """A thousand external streams, each wrapped, recorded on and dropped
    (NCCL communicators, TensorRT contexts made and destroyed for weeks):
    the module's dicts end as they began. Keyed by handle, each kept a key
    and a seq for ever."""
    gc.collect()
    before = (len(fences_mod._cuda_stream_keys), len(fences_mod._cuda_seqs))
    for i in range(1000):
        stream = _FakeStream(0x7F00_1000_0000 + 0x100 * i, external=True)
        _record(stream)
        _record(stream)
        del stream
    gc.collect()
    assert (len(fences_mod._cuda_stream_keys), len(fences_mod._cuda_seqs)) == before
    assert not getattr(fences_mod, "_cuda_external", {})


# -- the agreement's buffers ---------------------------------------------------


def test_the_agreement_buffers_die_with_their_thread(group: Any) -> None:
    """A thread of a pool that comes and goes agreed once: its reused
    buffers go when it ends. Kept by ``threading.get_ident()``, they stayed
    for the process's life, one pair per thread ever seen (and a new thread
    given the dead one's ident took them over)."""
    device = torch.device("cpu")
    kept: list[weakref.ref[torch.Tensor]] = []

    def body() -> None:
        agreement_mod._all_reduce_min([3, 1, 2], group, device)
        here = agreement_mod._all_reduce_min([5, 4, 6], group, device)
        assert here == [5, 4, 6]
        bufs = cast(Any, agreement_mod._buffers)
        found = bufs.by_shape.values() if hasattr(bufs, "by_shape") else bufs.values()
        kept.extend(weakref.ref(host) for host, _ in found)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive() and kept
    del thread
    gc.collect()
    assert [ref() for ref in kept] == [None] * len(kept)


# -- the wake-ups' bounce counts ------------------------------------------------


def test_the_delayed_rewatch_forgets_the_counts_once_the_watcher_is_gone() -> None:
    """The pool closed (its watcher gone) while a delayed re-watch waited:
    nothing will re-watch those fences, so nothing reads their bounce
    counts again. They were kept (by id) for the pool's life."""
    settled, still = EventFence(), EventFence()
    wakeups = _with_ledger(_Ledger([still]), _Timers())
    wakeups._bounces.update({id(settled): 2, id(still): 3})
    wakeups._rewatch_due = [settled, still]
    assert wakeups.watcher is None
    wakeups._rewatch_due_now()
    assert wakeups._bounces == {} and wakeups._rewatch_due == []


def test_close_forgets_the_delayed_rewatch_and_the_bounce_counts() -> None:
    """``close()`` with a delayed re-watch armed: the fences it holds (a
    CUDA event, a transfer handle kept alive for no one) and every count go
    at once, not when a timer that may never fire runs."""
    fence = EventFence()
    wakeups = _with_ledger(_Ledger([]), _Timers())
    watcher = _Watcher([])
    watcher.stop = lambda: None  # type: ignore[attr-defined]
    wakeups.watcher = cast(Any, watcher)
    wakeups._bounces[id(fence)] = 2
    wakeups._rewatch_later([fence], 2)
    fence_ref = weakref.ref(fence)
    del fence
    wakeups.close()
    gc.collect()
    assert fence_ref() is None
    assert wakeups._bounces == {} and wakeups._rewatch_due == []


# -- the explicit ledgers' retired marks -----------------------------------------


def test_forget_stream_keeps_the_retired_marks_to_the_streams_in_use() -> None:
    """A stream key per connection (``new_stream_key()``), retired when
    its transfer is processed, for weeks: each left a mark for ever. Each
    forgotten once done with, the marks stay at none, on both kinds of
    pool, the same calls on every rank."""
    rows = ReqToTokenPool(8, 4, reclaim="explicit")
    pages = KVPagePool(16, 4, reclaim="explicit")
    start = (rows.available_size(), pages.available_size())
    for _ in range(500):
        stream = FakeStream()
        row = rows.alloc(1)
        page = pages.alloc(1)
        assert row is not None and page is not None
        fence = stream.record()
        rows.free(row, fence=fence)
        pages.free(page, fence=fence)
        assert rows.retire(fence) == 1 and pages.retire(fence) == 1
        assert rows.forget_stream(stream.key) and pages.forget_stream(stream.key)
    assert rows._ledger._retired == {} and pages._ledger._retired == {}
    assert (rows.available_size(), pages.available_size()) == start


def test_forget_stream_on_a_pool_with_pages_forgets_both() -> None:
    kv = KVPagePool(16, 4, reclaim="explicit")
    pool = AsyncReqToTokenPool(8, 4, kv=kv, reclaim="explicit")
    stream = FakeStream()
    fence = stream.record()
    assert pool.retire(fence) == (0, 0)
    assert pool._ledger._retired and kv._ledger._retired
    assert pool.forget_stream(stream.key) is True
    assert pool._ledger._retired == {} and kv._ledger._retired == {}
    assert pool.forget_stream(stream.key) is False  # nothing left to forget


def test_a_forgotten_stream_is_no_longer_known_retired() -> None:
    """Retired, a fence frees at once what is freed behind it; forgotten,
    such a free waits again (for a retire of the stream, or agree)."""
    pool = ReqToTokenPool(8, 4, reclaim="explicit")
    stream = FakeStream()
    old = stream.record()
    pool.retire(old)
    row = pool.alloc(1)
    assert row is not None
    pool.free(row, fence=old)
    assert pool.pending_size() == 0  # retired: free at once
    pool.forget_stream(stream.key)
    row = pool.alloc(1)
    assert row is not None
    pool.free(row, fence=old)
    assert pool.pending_size() == 1
    assert pool.retire(old) == 1


def test_forget_stream_refuses_and_changes_nothing() -> None:
    """A key that is not an int, an auto pool, and batches still waiting
    behind a fence of the stream are refused, every mark left as it was."""
    pool = ReqToTokenPool(8, 4, reclaim="explicit")
    stream = FakeStream()
    first = stream.record()
    pool.retire(first)
    row = pool.alloc(1)
    assert row is not None
    pool.free(row, fence=stream.record())  # waits for a retire of seq 2
    marks = dict(pool._ledger._retired)
    for bad in ("1", True, 1.0, None):
        with pytest.raises(TypeError, match="stream key"):
            pool.forget_stream(bad)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="1 batch"):
        pool.forget_stream(stream.key)
    assert pool._ledger._retired == marks and pool.pending_size() == 1
    with pytest.raises(RuntimeError, match="explicit"):
        ReqToTokenPool(8, 4).forget_stream(stream.key)


def test_forget_stream_refuses_a_stream_a_batch_still_waits_for_behind_another() -> None:
    """A free behind two streams' fences queues behind the first; the
    second's retire marks it done for when the walk reaches it. Forgotten
    meanwhile, that mark was gone when the first was retired: the row
    waited for a retire of a stream done with (or for agree). A fence the
    batch still waits for after its head counts as waiting behind it, on
    every kind of explicit pool; refused, nothing changed."""
    kv = KVPagePool(16, 4, reclaim="explicit")
    pool = AsyncReqToTokenPool(8, 4, kv=kv, reclaim="explicit")
    rows = ReqToTokenPool(8, 4, reclaim="explicit")
    bare = KVPagePool(16, 4, reclaim="explicit")
    first, second = FakeStream(), FakeStream()
    head, rest = first.record(), second.record()
    row = rows.alloc(1)
    page, bare_page = kv.alloc(1), bare.alloc(1)
    assert row is not None and page is not None and bare_page is not None
    rows.free(row, fence=[head, rest])
    kv.free(page, fence=[head, rest])
    bare.free(bare_page, fence=[head, rest])
    assert rows.retire(rest) == 0 and pool.retire(rest) == (0, 0) and bare.retire(rest) == 0
    for owner in (rows, pool, bare):
        with pytest.raises(RuntimeError, match="1 batch"):
            owner.forget_stream(second.key)
    for led in (rows._ledger, kv._ledger, bare._ledger):
        assert led._retired[second.key] == rest.seq
    assert rows.retire(head) == 1 and pool.retire(head) == (0, 1) and bare.retire(head) == 1
    assert rows.pending_size() == 0 and kv.pending_size() == 0 and bare.pending_size() == 0
    # Nothing waits behind it now: forgotten.
    assert rows.forget_stream(second.key) and pool.forget_stream(second.key)
    assert bare.forget_stream(second.key)


def test_forget_stream_drops_the_retired_uses_of_rows_and_refuses_the_open_ones() -> None:
    """A row's recorded use is a fence its free waits for. Retired, the
    free is free of it at once; the mark forgotten, that free waited for a
    retire of a stream done with (or agree). Forgetting drops the uses its
    retire covers with the mark, so the free stays free at once, and
    refuses a stream a row's use of which is not retired yet, nothing
    changed."""
    rows = ReqToTokenPool(8, 4, reclaim="explicit")
    stream, other = FakeStream(), FakeStream()
    done, keep = rows.alloc(1), rows.alloc(1)
    assert done is not None and keep is not None
    old, other_fence = stream.record(), other.record()
    rows.record_use(done, [old, other_fence])
    rows.retire(old)
    assert rows.forget_stream(stream.key) is True
    assert rows._ledger._retired.get(stream.key) is None
    rows.retire(other_fence)
    assert rows.free(done) == 1 and rows.pending_size() == 0  # at once, as with the mark
    # A use not retired yet: refused, the mark and the use as they were.
    rows.retire(stream.record())
    newer = stream.record()
    rows.record_use(keep, newer)
    marks = dict(rows._ledger._retired)
    with pytest.raises(RuntimeError, match="1 allocated row"):
        rows.forget_stream(stream.key)
    assert rows._ledger._retired == marks
    rows.retire(newer)
    assert rows.forget_stream(stream.key) is True
    assert rows.free(keep) == 1 and rows.pending_size() == 0


def test_forget_stream_on_a_pools_page_pool_is_refused_for_the_pools() -> None:
    """The page pool of an ``AsyncReqToTokenPool`` forgot its own mark and
    left the rows' recorded uses its retire covered (they live in the
    rows' ledger): a row freed after it was free at once, its pages then
    waited behind that retired use for a retire of a stream done with.
    Refused there, nothing changed; the pool's call forgets both, and the
    row and its pages are free at once."""
    kv = KVPagePool(16, 4, reclaim="explicit")
    pool = AsyncReqToTokenPool(8, 4, kv=kv, reclaim="explicit")
    stream = FakeStream()
    grant = pool.try_admit(pages=3)
    assert grant is not None
    fence = stream.record()
    pool.record_use(grant.row, fence)
    pool.retire(fence)
    marks = (dict(pool._ledger._retired), dict(kv._ledger._retired))
    with pytest.raises(RuntimeError, match="call that pool's forget_stream"):
        kv.forget_stream(stream.key)
    assert (dict(pool._ledger._retired), dict(kv._ledger._retired)) == marks
    assert pool.forget_stream(stream.key) is True
    free = kv.available_size()
    assert pool.free(grant.row) == 1
    assert kv.pending_size() == 0 and kv.available_size() == free + 3
    pool.check_invariants()


async def test_forget_stream_on_a_pool_with_pages_drops_the_retired_use_for_both() -> None:
    """The row's pages wait for its recorded uses too: dropped with the
    mark, the row and its pages are free at once, as with the mark."""
    kv = KVPagePool(16, 4, reclaim="explicit")
    pool = AsyncReqToTokenPool(8, 4, kv=kv, reclaim="explicit")
    stream = FakeStream()
    start = (pool.available_size(), kv.available_size())
    async with asyncio.timeout(WAIT_S):
        row, _ = await pool.admit(2)
    fence = stream.record()
    pool.record_use(row, fence)
    pool.retire(fence)
    assert pool.forget_stream(stream.key) is True
    pool.free(row)
    assert pool.pending_size() == 0 and kv.pending_size() == 0
    assert (pool.available_size(), kv.available_size()) == start


def _bytes_a_retired_key(pool: Any, keys: int = 8_000) -> float:
    """What ``retire`` keeps a stream key after its fence is gone: the mark
    (a dict entry) and the key and seq it holds (traced allocations)."""

    class _Ordered:
        __slots__ = ("seq", "stream_key")

        def __init__(self, stream_key: int, seq: int) -> None:
            self.stream_key, self.seq = stream_key, seq

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(keys):
            pool.retire(_Ordered(fences_mod.new_stream_key(), 1_000 + i))
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename")) / keys


def test_the_bytes_a_retired_key_costs_are_as_the_docs_say() -> None:
    """The README, docs/api.md and docs/tp.md put a figure on a retired stream's mark
    (what ``forget_stream`` gives back): about 100 B, the dict entry plus the
    key and seq it keeps alive once the fence is gone (they said 32 B, the
    entry alone); a pool with ``kv=`` keeps one in each ledger, sharing the
    ints."""
    one = _bytes_a_retired_key(ReqToTokenPool(8, 8, reclaim="explicit"))
    both = _bytes_a_retired_key(
        AsyncReqToTokenPool(8, 8, reclaim="explicit", kv=KVPagePool(16, 4, reclaim="explicit"))
    )
    assert one < both < 2 * one
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    api = " ".join((root / "docs/api.md").read_text().split())
    tp = " ".join((root / "docs/tp.md").read_text().split())
    quoted = (
        re.findall(r"about (\d+) B a key", readme)
        + re.findall(r"keeps a mark \(about (\d+) B", api)
        + re.findall(r"one mark per stream key it retired \(about (\d+) B", tp)
    )
    assert len(quoted) == 3, quoted
    for figure in map(int, quoted):
        assert 0.75 * one <= figure <= 1.25 * one, (figure, one)
    with_kv = re.findall(r"`kv=`[^.]*?about (\d+) B", api) + re.findall(
        r"(\d+) B on a pool with `kv=`", tp
    )
    assert with_kv and all(0.75 * both <= int(b) <= 1.25 * both for b in with_kv), (with_kv, both)
