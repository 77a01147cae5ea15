"""A stream passed as ``fence=`` is a ``TypeError`` that says to pass ``after=``.

A torch stream (``torch.Stream``, ``torch.cuda.Stream``) has ``query()`` and
``synchronize()``, so ``free(rows, fence=stream)`` passed as a fence of
unknown origin that completes once the stream is idle: on a busy forward
stream, perhaps never, and the rows were held (and polled) meanwhile. What
the caller meant is almost certainly ``after=stream``: a fence recorded on
it now, behind the work queued so far. Every call that takes a fence
refuses a stream, alone or as an element of a sequence, with a
``TypeError`` naming ``after=stream`` and ``record_fence(stream)``, the pool
unchanged and the stream never asked. A ``HostStream`` (no ``query()``)
was refused already; its error now says the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import bounded, kv_pool_state, kv_snapshot, pool_snapshot

from asyncpool import (
    AsyncReqToTokenPool,
    HostStream,
    KVPagePool,
    ReqToTokenPool,
    record_fence,
    wait_fence,
)

HINT = r"a stream, not a fence.*after=stream.*record_fence\(stream\)"


class DuckStream:
    """A device stream that follows torch's stream API (an XPU or NPU
    stream, say): ``wait_stream``/``record_event`` beside
    ``query``/``synchronize``. Counts its queries: none may be made."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return False  # busy: as a fence it would hold memory for ever

    def synchronize(self) -> None:
        raise AssertionError("never called by the pool")

    def wait_stream(self, other: object) -> None:
        raise AssertionError("never called by the pool")

    def record_event(self, event: object = None) -> object:
        raise AssertionError("never called by the pool")


class Transfer:
    """A transfer handle: a fence of unknown origin, still a fence even with
    a ``record`` and a ``wait`` of its own (as ``torch.cuda.Event`` has)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


def _streams() -> dict[str, Callable[[], Any]]:
    return {
        "torch.Stream": lambda: torch.Stream(device="cpu"),
        "duck stream": DuckStream,
    }


STREAMS = list(_streams())


def test_what_is_a_stream() -> None:
    from asyncpool.fences import is_fence, is_stream

    assert is_stream(torch.Stream(device="cpu")) and not is_fence(torch.Stream(device="cpu"))
    assert is_stream(DuckStream()) and not is_fence(DuckStream())
    with HostStream() as hs:
        assert is_stream(hs) and not is_fence(hs)
        assert is_fence(hs.record()) and not is_stream(hs.record())
    assert is_fence(Transfer()) and not is_stream(Transfer())
    # The classes are neither.
    assert not is_stream(DuckStream) and not is_fence(DuckStream)
    assert not is_stream(torch.Stream)


def _sync_calls(stream: Any) -> list[tuple[str, Callable[[ReqToTokenPool, list[int]], Any]]]:
    other = Transfer()
    return [
        ("free", lambda p, rows: p.free(rows, fence=stream)),
        ("free positional", lambda p, rows: p.free(rows, stream)),
        ("free in a list", lambda p, rows: p.free(rows, fence=[other, stream])),
        ("free in a tuple", lambda p, rows: p.free(rows, fence=(stream,))),
        ("record_use", lambda p, rows: p.record_use(rows, stream)),
        ("record_use in a list", lambda p, rows: p.record_use(rows, [other, stream])),
        ("force_release", lambda p, rows: p.force_release(stream)),
    ]


@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("call", [name for name, _ in _sync_calls(None)])
def test_the_sync_pool_refuses_a_stream(kind: str, call: str) -> None:
    stream = _streams()[kind]()
    pool = ReqToTokenPool(6, 4)
    rows = pool.alloc(3)
    assert rows is not None
    pool.free(rows[:1], fence=DuckTransferOpen())  # something pending, too
    before = pool_snapshot(pool)
    fn = dict(_sync_calls(stream))[call]
    with pytest.raises(TypeError, match=HINT):
        fn(pool, rows[1:])
    assert pool_snapshot(pool) == before
    assert getattr(stream, "queries", 0) == 0


class DuckTransferOpen:
    """A transfer handle still in flight."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("never called by the pool")


def test_the_error_names_the_element() -> None:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(1)
    with pytest.raises(TypeError, match=r"^fence=\[1\] got .*a stream, not a fence"):
        pool.free(rows, fence=[Transfer(), DuckStream()])
    with pytest.raises(TypeError, match=r"^fence= got .*a stream, not a fence"):
        pool.free(rows, fence=DuckStream())


@pytest.mark.parametrize("kind", STREAMS)
def test_explicit_retire_refuses_a_stream(kind: str) -> None:
    stream = _streams()[kind]()
    pool = ReqToTokenPool(4, 4, reclaim="explicit")
    pool.alloc(1)
    before = pool_snapshot(pool)
    with pytest.raises(TypeError):
        pool.retire(stream)
    assert pool_snapshot(pool) == before
    assert getattr(stream, "queries", 0) == 0


@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("form", ["one", "list"])
@pytest.mark.parametrize("call", ["free", "force_release"])
def test_the_page_pool_refuses_a_stream(kind: str, form: str, call: str) -> None:
    stream = _streams()[kind]()
    kv = KVPagePool(9, 4)
    pages = kv.alloc(4)
    assert pages is not None
    kv.free(pages[:1], fence=DuckTransferOpen())
    before = kv_snapshot(kv)
    fence: Any = stream if form == "one" else [Transfer(), stream]
    with pytest.raises(TypeError, match=HINT if call == "free" or form == "one" else "fence"):
        if call == "free":
            kv.free(pages[1:], fence=fence)
        else:
            kv.force_release(fence)
    assert kv_snapshot(kv) == before
    assert getattr(stream, "queries", 0) == 0


def _async_calls(stream: Any, hs: HostStream) -> dict[str, Callable[[Any, int, Any], Any]]:
    other = Transfer()
    return {
        "free": lambda p, row, spare: p.free([row], fence=stream),
        "free in a list": lambda p, row, spare: p.free([row], fence=[other, stream]),
        "free with after=": lambda p, row, spare: p.free([row], fence=stream, after=hs),
        "record_use": lambda p, row, spare: p.record_use([row], stream),
        "record_use in a list": lambda p, row, spare: p.record_use([row], (other, stream)),
        "trim_pages": lambda p, row, spare: p.trim_pages([row], 1, fence=stream),
        "trim_pages in a list": lambda p, row, spare: p.trim_pages([row], 1, fence=[stream]),
        "trim_pages with after=": lambda p, row, spare: p.trim_pages(
            [row], 1, fence=stream, after=hs
        ),
        "kv.free": lambda p, row, spare: p.kv.free(spare, fence=stream),
        "force_release": lambda p, row, spare: p.force_release(stream),
    }


ASYNC_CALLS = list(_async_calls(None, None))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("call", ASYNC_CALLS)
async def test_the_async_pool_refuses_a_stream(kind: str, call: str) -> None:
    stream = _streams()[kind]()
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(17, 4))
    with HostStream() as hs:
        g = pool.try_admit(pages=2)
        pending = pool.try_admit(pages=2)
        assert g is not None and pending is not None
        pool.free([pending.row], fence=DuckTransferOpen())
        spare = pool.kv.alloc(1)  # a bare page of the caller's, for kv.free
        before = kv_pool_state(pool)
        kv_before = kv_snapshot(pool.kv)
        with pytest.raises(TypeError, match=HINT):
            _async_calls(stream, hs)[call](pool, g.row, spare)
        assert kv_pool_state(pool) == before
        assert kv_snapshot(pool.kv) == kv_before
        assert getattr(stream, "queries", 0) == 0
        # The right spellings work: after=stream, or a fence recorded on it.
        assert pool.free([g.row], fence=record_fence(hs), after=hs) in (0, 1)
    async with bounded():
        await pool.close()


@pytest.mark.parametrize("kind", STREAMS)
async def test_an_explicit_async_pool_refuses_a_stream_to_retire(kind: str) -> None:
    stream = _streams()[kind]()
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(17, 4), reclaim="explicit")
    assert pool.try_admit(pages=2) is not None
    before = kv_pool_state(pool)
    with pytest.raises(TypeError):
        pool.retire(stream)
    assert kv_pool_state(pool) == before
    async with bounded():
        await pool.close()


@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("form", ["one", "list"])
async def test_wait_fence_refuses_a_stream(kind: str, form: str) -> None:
    stream = _streams()[kind]()
    fence: Any = stream if form == "one" else [Transfer(), stream]
    async with bounded():
        with pytest.raises(TypeError, match=HINT):
            await wait_fence(fence)
    assert getattr(stream, "queries", 0) == 0


async def test_a_host_stream_as_a_fence_says_what_to_pass() -> None:
    pool = AsyncReqToTokenPool(4, 8)
    rows = pool.try_alloc(1)
    assert rows is not None
    with HostStream() as hs:
        before = pool_snapshot(pool)
        with pytest.raises(TypeError, match=HINT):
            pool.free(rows, fence=hs)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=HINT):
            pool.record_use(rows, [hs])  # type: ignore[list-item]
        assert pool_snapshot(pool) == before
        pool.free(rows, after=hs)
    async with bounded():
        await pool.close()


@pytest.mark.cuda
def test_a_cuda_stream_is_refused_and_after_takes_it() -> None:
    from asyncpool.fences import is_fence, is_stream

    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    assert is_stream(stream) and not is_fence(stream)
    assert is_stream(torch.cuda.current_stream())  # type: ignore[no-untyped-call]
    event = torch.cuda.Event()  # a bare event is still a fence of unknown origin
    assert is_fence(event) and not is_stream(event)
    pool = ReqToTokenPool(4, 4, device="cuda")
    rows = pool.alloc(1)
    before = pool_snapshot(pool)
    with pytest.raises(TypeError, match=HINT):
        pool.free(rows, fence=stream)
    assert pool_snapshot(pool) == before
    pool.free(rows, after=stream)
    stream.synchronize()  # type: ignore[no-untyped-call]
    assert pool.available_size() == 3
