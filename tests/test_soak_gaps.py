"""What a soak trial (a long-running process: millions of operations, pools
made and dropped) found kept alive for too long; each test fails without
its fix:

* the error kept in ``last_fence_error`` carried the traceback of the
  faulted ``query()``, whose frames reach, through ``f_back``, every frame
  of the call that met the fault: the faulted fence itself (remembered
  only weakly on purpose) and the engine's step that freed the request,
  with all its locals (a batch's tensors), until the next fault.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from asyncpool import AsyncReqToTokenPool, FenceError, HostStream, KVPagePool, ReqToTokenPool


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
