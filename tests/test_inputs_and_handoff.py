"""Issue 14: what engines hold as row ids, messages that read as sentences,
one ``free`` signature, the lease's exit rule, the thread hand-off, reset
batching and bookkeeping bytes that do not grow with generations."""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import re
import threading
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import WAIT_S, FakeStream, assert_conserved, bounded, pool_snapshot, spin

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    DeviceError,
    DoubleFreeError,
    HostStream,
    InvalidSlotError,
    KVPagePool,
    PoolBusyError,
    PoolError,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
    WrongThreadError,
)

# ---------------------------------------------------------------- inputs

# Each maker turns a list of row ids into what an engine might hold.
ROW_FORMS: dict[str, Callable[[list[int]], Any]] = {
    "numpy-int64-array": lambda rows: np.array(rows, dtype=np.int64),
    "numpy-int32-array": lambda rows: np.array(rows, dtype=np.int32),
    "numpy-uint16-array": lambda rows: np.array(rows, dtype=np.uint16),
    "torch-int64-tensor": lambda rows: torch.tensor(rows, dtype=torch.int64),
    "torch-int32-tensor": lambda rows: torch.tensor(rows, dtype=torch.int32),
    "list-of-numpy-scalars": lambda rows: [np.int64(r) for r in rows],
    "list-of-0d-tensors": lambda rows: [torch.tensor(r) for r in rows],
    "tuple-mixed": lambda rows: tuple(
        np.int32(r) if i % 2 else torch.tensor(r) for i, r in enumerate(rows)
    ),
    "generator": lambda rows: (np.int64(r) for r in rows),
}
ONE_ROW_FORMS: dict[str, Callable[[int], Any]] = {
    "numpy-int64": np.int64,
    "numpy-uint8": np.uint8,
    "torch-0d": torch.tensor,
    "torch-0d-int32": lambda r: torch.tensor(r, dtype=torch.int32),
    "numpy-0d-array": lambda r: np.array(r),
}


def _pools() -> list[Any]:
    return [ReqToTokenPool(9, 16), AsyncReqToTokenPool(9, 16)]


async def _alloc(pool: Any, n: Any) -> list[int]:
    if isinstance(pool, AsyncReqToTokenPool):
        async with asyncio.timeout(WAIT_S):
            return await pool.alloc(n)
    rows = pool.alloc(n)
    assert rows is not None
    return rows


@pytest.mark.parametrize("form", ROW_FORMS)
async def test_free_and_record_use_accept_integer_arrays_and_scalars(form, kit):
    make_rows = ROW_FORMS[form]
    for pool in _pools():
        rows = await _alloc(pool, 4)
        stream = kit.stream()
        gate = kit.gate(stream)
        pool.record_use(make_rows(rows[:2]), stream.record())
        assert pool.free(make_rows(rows)) == 2  # two wait for the fence
        assert pool.pending_size() == 2
        gate.open()
        stream.synchronize()
        pool.reclaim()
        assert pool.allocated_size() == 0
        assert_conserved(pool) if isinstance(pool, AsyncReqToTokenPool) else pool.check_invariants()
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


@pytest.mark.parametrize("form", ONE_ROW_FORMS)
async def test_one_row_as_an_integer_scalar_or_0d_tensor(form):
    make_row = ONE_ROW_FORMS[form]
    for pool in _pools():
        rows = await _alloc(pool, 2)
        pool.set_req_pool_info(
            make_row(rows[0]), ReqToTokenPoolInfo(1, 2, torch.tensor([5, 6], dtype=torch.int32))
        )
        assert pool.alloced_lens_cpu[rows[0]] == 2
        assert pool.free(make_row(rows[0])) == 1
        assert pool.free(make_row(rows[1]), None) == 1
        assert pool.allocated_size() == 0
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.int32])
async def test_an_index_write_takes_slot_ids_of_any_integer_dtype(dtype):
    # Page ids are int64, so the slots an engine computes from them are too:
    # an index write (tensors as indices) refused them where a slice write
    # casts; both land now, as the table's int32.
    for pool in _pools():
        row = (await _alloc(pool, 1))[0]
        cols = torch.arange(3)
        pool.write((torch.full((3,), row), cols), torch.tensor([5, 6, 7], dtype=dtype))
        pool.write((row, slice(3, 5)), torch.tensor([8, 9], dtype=dtype))
        assert pool.req_to_token[row, :5].tolist() == [5, 6, 7, 8, 9]
        assert pool.req_to_token.dtype == torch.int32
        pool.free([row])
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


async def test_an_index_write_wraps_past_int32_as_a_slice_write_does():
    # write() is the seed's raw write: unchecked. An int64 value past int32
    # wraps the same way whether the write indexes with tensors (cast first)
    # or slices (torch casts), so the two forms never disagree on a slot.
    big = torch.tensor([2**31 + 5, -(2**31) - 1], dtype=torch.int64)
    wrapped = big.to(torch.int32).tolist()
    assert wrapped == [-(2**31) + 5, 2**31 - 1]
    for pool in _pools():
        row = (await _alloc(pool, 1))[0]
        pool.write((torch.full((2,), row), torch.arange(2)), big)
        pool.write((row, slice(2, 4)), big)
        assert pool.req_to_token[row, :4].tolist() == wrapped + wrapped
        pool.free([row])
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


async def test_counts_accept_integer_scalars():
    sync = ReqToTokenPool(9, 16)
    assert sync.alloc(np.int64(3)) == [1, 2, 3]
    async with AsyncReqToTokenPool(9, 16) as pool:
        assert await pool.alloc(np.int32(2)) == [1, 2]
        assert pool.try_alloc(torch.tensor(1)) == [3]
        async with pool.lease(np.int64(2)) as rows:
            assert rows == [4, 5]
        assert pool.allocated_size() == 3


BAD_ROWS: list[tuple[str, Any, str]] = [
    ("numpy-float", np.float64(1.0), "1.0"),
    ("torch-float-0d", torch.tensor(1.0), "1."),
    ("torch-float-1d", torch.tensor([1.0, 2.0]), "1.0"),
    ("numpy-float-array", np.array([1.5]), "1.5"),
    ("numpy-bool", np.bool_(True), "True"),
    ("torch-bool-0d", torch.tensor(True), "True"),
    ("torch-bool-1d", torch.tensor([True, False]), "True"),
    ("bool-in-list", [1, True], "True"),
    ("float-in-tuple", (1, 2.0), "2.0"),
    ("2d-tensor", torch.tensor([[1, 2]]), "2-D"),
    ("2d-array", np.array([[1], [2]]), "2-D"),
    ("string", "12", "'12'"),
    # Bytes are not row ids, whatever wraps them (a memoryview has ndim and
    # tolist, as an array does).
    ("bytes", bytes([1, 2]), "b'"),
    ("bytearray", bytearray([1, 2]), "bytearray"),
    ("memoryview", memoryview(bytes([1, 2])), "memoryview"),
]


@pytest.mark.parametrize("name,rows,culprit", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
async def test_floats_bools_and_bad_shapes_are_refused_naming_the_value(name, rows, culprit):
    for pool in _pools():
        held = await _alloc(pool, 3)
        before = pool_snapshot(pool)
        with pytest.raises(InvalidSlotError) as info:
            pool.free(rows)
        assert culprit in str(info.value), str(info.value)
        with pytest.raises(InvalidSlotError):
            pool.record_use(rows, FakeStream().record())
        assert pool_snapshot(pool) == before
        pool.free(held)
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


async def test_pages_and_page_counts_refuse_bytes_and_memoryviews():
    kv = KVPagePool(9, 4)
    pages = kv.alloc(2)
    assert pages is not None
    async with AsyncReqToTokenPool(5, 16, kv=KVPagePool(9, 4)) as pool:
        async with asyncio.timeout(WAIT_S):
            grant = await pool.admit(pages=1)
        before = pool_snapshot(pool)
        for bad in (bytes(pages.tolist()), memoryview(bytes(pages.tolist()))):
            with pytest.raises(InvalidSlotError, match="pages must be"):
                kv.free(bad)
            # Per-row counts as bytes would read as small ints: refused.
            with pytest.raises(CapacityError):
                pool.extend_rows([grant.row], memoryview(bytes([1])))
        assert kv.allocated_size() == 2
        assert pool_snapshot(pool) == before
        pool.free([grant.row])


@pytest.mark.parametrize("bad", [np.float64(2.0), torch.tensor(2.0), np.bool_(True), True, 2.0])
async def test_counts_refuse_floats_and_bools(bad):
    with pytest.raises(CapacityError, match=re.escape(repr(bad)) if bad is not True else "True"):
        ReqToTokenPool(9, 16).alloc(bad)
    async with AsyncReqToTokenPool(9, 16) as pool:
        with pytest.raises(CapacityError):
            async with bounded():  # a lost check must fail, not hang
                await pool.alloc(bad)
        with pytest.raises(CapacityError):
            pool.try_alloc(bad)
        assert pool.allocated_size() == 0


# One element, but not one integer: torch's ``__index__`` takes a one-element
# 1-D tensor (and a bool tensor) as an int, so each of these was once granted.
NOT_SCALARS = [torch.tensor([2]), np.array([2]), torch.tensor([[2]]), torch.tensor(True)]


@pytest.mark.parametrize("bad", NOT_SCALARS, ids=["tensor-1d", "array-1d", "tensor-2d", "bool-0d"])
async def test_counts_refuse_one_element_arrays_and_bool_tensors(bad):
    """A count is one integer: an array or tensor of one element is refused
    (not read as its element), on rows and on pages, and nothing changes."""
    with pytest.raises(CapacityError, match="integer"):
        ReqToTokenPool(9, 16).alloc(bad)
    kv = KVPagePool(17, 1)
    with pytest.raises(CapacityError, match="integer"):
        kv.alloc(bad)
    assert kv.available_size() == 16
    async with AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 1)) as pool:
        g = await pool.admit(pages=1)
        before = pool_snapshot(pool)
        with pytest.raises(CapacityError, match="integer"):
            async with bounded():  # a lost check must fail, not hang
                await pool.alloc(bad)
        with pytest.raises(CapacityError, match="integer"):
            pool.try_alloc(bad)
        with pytest.raises(CapacityError, match="integer"):
            async with bounded():
                await pool.admit(pages=bad)
        with pytest.raises(CapacityError, match="integer"):
            pool.try_admit(pages=bad)
        with pytest.raises(CapacityError, match="integer"):
            pool.extend(g.row, bad)
        if bad.ndim == 1:
            # extend_rows takes a 1-D k as one count per row (its per-row
            # form), never as a scalar: of the wrong length it is refused.
            with pytest.raises(CapacityError, match="1 page counts for 2 rows"):
                pool.extend_rows([g.row, g.row + 1], bad)
        else:
            with pytest.raises(CapacityError, match="integer"):
                pool.extend_rows([g.row], bad)
        assert pool_snapshot(pool) == before
        assert pool.pages_of(g.row).tolist() == g.pages.tolist()


@pytest.mark.parametrize("bad", NOT_SCALARS, ids=["tensor-1d", "array-1d", "tensor-2d", "bool-0d"])
async def test_single_row_arguments_refuse_one_element_arrays(bad):
    """Calls that take one row (``extend``, ``pages_of``, ``detach_pages``,
    ``set_req_pool_info``) refuse a one-element array or a bool tensor with
    InvalidSlotError, changing nothing; a 0-d integer tensor is accepted."""
    sync = ReqToTokenPool(9, 16)
    assert sync.alloc(2) == [1, 2]
    info = ReqToTokenPoolInfo(0, 0, torch.zeros(0, dtype=torch.int32))
    with pytest.raises(InvalidSlotError, match="integer"):
        sync.set_req_pool_info(bad, info)
    async with AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 1)) as pool:
        g = await pool.admit(pages=2)
        before = pool_snapshot(pool)
        for call in (
            lambda: pool.extend(bad, 1),
            lambda: pool.pages_of(bad),
            lambda: pool.detach_pages(bad),
        ):
            with pytest.raises(InvalidSlotError):
                call()
        assert pool_snapshot(pool) == before
        assert pool.pages_of(torch.tensor(g.row)).tolist() == g.pages.tolist()


@pytest.mark.parametrize("bad", [np.float64(1.0), torch.tensor(1.5), True, np.bool_(True)])
def test_set_req_pool_info_refuses_non_integer_rows(bad):
    pool = ReqToTokenPool(9, 16)
    pool.alloc(2)
    with pytest.raises(InvalidSlotError, match="integer"):
        pool.set_req_pool_info(bad, ReqToTokenPoolInfo(0, 0, torch.zeros(0, dtype=torch.int32)))


# ---------------------------------------------------------------- messages


async def test_duplicate_rows_say_the_row_appears_twice():
    for pool in _pools():
        rows = await _alloc(pool, 2)
        fence = FakeStream().record()
        for bad in ([rows[0], rows[0]], [rows[1], rows[0], rows[1]]):
            with pytest.raises(InvalidSlotError, match=r"row \d appears twice in this call"):
                pool.free(bad)
            with pytest.raises(InvalidSlotError, match=r"row \d appears twice in this call"):
                pool.record_use(bad, fence)
        assert pool.allocated_size() == 2
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


async def test_timeout_names_its_seconds():
    async with AsyncReqToTokenPool(3, 4) as pool:
        held = await pool.alloc(2)
        with pytest.raises(TimeoutError, match=r"alloc\(1\) timed out after 0.01 s: 1 row "):
            async with asyncio.timeout(WAIT_S):
                await pool.alloc(1, timeout=0.01)
        with pytest.raises(TimeoutError, match=r"2 rows could not be granted"):
            async with asyncio.timeout(WAIT_S):
                await pool.alloc(2, timeout=0)
        pool.free(held)


@pytest.mark.parametrize("cls", [ReqToTokenPool, AsyncReqToTokenPool])
@pytest.mark.parametrize(
    "size,rule",
    [(5.0, "size must be an int"), (True, "size must be an int"), (1, "size must be at least 2")],
)
def test_size_messages(cls, size, rule):
    with pytest.raises(CapacityError, match=rule) as info:
        cls(size, 8)
    assert repr(size) in str(info.value)


# Sizes an engine computes with numpy or torch (from a memory budget).
INTEGER_SIZES: dict[str, Callable[[int], Any]] = {
    "numpy-int64": np.int64,
    "numpy-uint32": np.uint32,
    "torch-0d": torch.tensor,
}


@pytest.mark.parametrize("form", INTEGER_SIZES)
async def test_constructors_read_integer_scalars_as_ints(form):
    make = INTEGER_SIZES[form]
    sync = ReqToTokenPool(make(5), make(16))
    kv = KVPagePool(make(9), make(4))
    pool = AsyncReqToTokenPool(make(5), make(16), kv=kv)
    for made in (sync, pool):
        assert type(made.size) is int and made.size == 5
        assert type(made.max_context_len) is int and made.max_context_len == 16
        assert tuple(made.req_to_token.shape) == (5, 16)
    assert type(kv.ledger.num_pages) is int and kv.capacity == 8
    assert type(kv.page_size) is int and kv.page_size == 4
    assert sync.alloc(4) == [1, 2, 3, 4]
    async with asyncio.timeout(WAIT_S):
        grant = await pool.admit(pages=8)
    assert kv.available_size() == 0
    pool.free([grant.row])
    await pool.close()


@pytest.mark.parametrize(
    "build,culprit",
    [
        (lambda: ReqToTokenPool(np.float64(5.0), 16), "size must be an int"),
        (lambda: ReqToTokenPool(np.bool_(True), 16), "size must be an int"),
        (lambda: ReqToTokenPool(torch.tensor([5]), 16), "size must be an int"),
        (lambda: ReqToTokenPool(5, np.float32(16.0)), "max_context_len must be a positive int"),
        (lambda: ReqToTokenPool(5, True), "max_context_len must be a positive int"),
        (lambda: KVPagePool(np.float64(9.0), 4), "num_pages must be an int"),
        (lambda: KVPagePool(9, np.bool_(True)), "page_size must be an int"),
        (lambda: KVPagePool(9, torch.tensor(4.0)), "page_size must be an int"),
    ],
)
def test_constructors_still_refuse_floats_bools_and_arrays(build, culprit):
    with pytest.raises((CapacityError, ValueError), match=culprit):
        build()


@pytest.mark.parametrize("timeout", [np.float32(0.01), np.float64(0.01), np.int64(0)])
async def test_a_numpy_timeout_times_out(timeout):
    async with AsyncReqToTokenPool(3, 4) as pool:
        held = await pool.alloc(2)
        with pytest.raises(TimeoutError, match=r"alloc\(1\) timed out after 0"):
            async with asyncio.timeout(WAIT_S):
                await pool.alloc(1, timeout=timeout)
        with pytest.raises(TimeoutError, match="could not be granted"):
            async with asyncio.timeout(WAIT_S):
                async with pool.lease(1, timeout=timeout):
                    pass
        pool.free(held)
        async with asyncio.timeout(WAIT_S):
            assert await pool.alloc(1, timeout=np.int64(5)) == [1]
        await pool.drain(timeout=np.float32(1.0))
    # fence_timeout and warn_after are numbers > 0: numpy numbers too.
    pool = AsyncReqToTokenPool(3, 4, fence_timeout=np.int64(2))
    assert pool.stats().overdue_fences == 0
    pool.hold_grants(warn_after=np.float32(1.0)).release()
    await pool.close()


@pytest.mark.parametrize("bad", [np.float32("nan"), np.float64(-1.0), np.bool_(True), True, "1"])
async def test_timeouts_refuse_nan_negatives_bools_and_text(bad):
    async with AsyncReqToTokenPool(3, 4) as pool:
        before = pool_snapshot(pool)
        with pytest.raises(ValueError, match="timeout must be None or a number >= 0"):
            async with asyncio.timeout(WAIT_S):
                await pool.alloc(1, timeout=bad)
        with pytest.raises(ValueError, match="timeout must be None or a number >= 0"):
            async with asyncio.timeout(WAIT_S):
                await pool.drain(timeout=bad)
        assert pool_snapshot(pool) == before
    with pytest.raises(ValueError, match="fence_timeout must be None or a finite number > 0"):
        AsyncReqToTokenPool(3, 4, fence_timeout=bad)


async def test_after_that_is_not_a_stream_names_the_after_parameter():
    for pool in _pools():
        rows = await _alloc(pool, 1)
        before = pool_snapshot(pool)
        with pytest.raises(TypeError, match=r"after= must be a HostStream .* got 'x' of type str"):
            pool.free(rows, after="x")
        assert pool_snapshot(pool) == before
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


async def test_after_a_closed_stream_names_it_and_frees_nothing():
    closed = HostStream("copy")
    closed.close()
    kv = KVPagePool(9, 4)
    pages = kv.alloc(2)
    with pytest.raises(RuntimeError, match="after= is copy, a HostStream that is closed"):
        kv.free(pages, after=closed)
    assert kv.allocated_size() == 2
    for pool in _pools():
        rows = await _alloc(pool, 1)
        before = pool_snapshot(pool)
        with pytest.raises(RuntimeError, match="nothing was freed"):
            pool.free(rows, after=closed)
        assert pool_snapshot(pool) == before
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


@pytest.mark.usefixtures("without_cuda")
@pytest.mark.parametrize("cls", [ReqToTokenPool, AsyncReqToTokenPool])
def test_cuda_device_without_cuda_is_a_clear_pool_error(cls):
    with pytest.raises(DeviceError, match="needs CUDA") as info:
        cls(4, 8, device="cuda")
    assert isinstance(info.value, PoolError) and isinstance(info.value, RuntimeError)


@pytest.mark.parametrize(
    "held,phrase", [(1, "while 1 row is still allocated"), (2, "while 2 rows are still allocated")]
)
async def test_release_memory_message_reads_as_a_sentence(held, phrase):
    async with AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(held)
        with pytest.raises(PoolBusyError, match=phrase):
            async with asyncio.timeout(WAIT_S):
                await pool.release_memory()
        pool.free(rows)


# ---------------------------------------------------------------- free signature


def test_both_pools_have_one_free_signature():
    def shape(fn: Any) -> list[tuple[str, Any]]:
        params = list(inspect.signature(fn).parameters.values())
        return [(p.name, p.kind) for p in params]

    sync, asyn = shape(ReqToTokenPool.free), shape(AsyncReqToTokenPool.free)
    assert [k for _, k in sync] == [k for _, k in asyn]
    assert [n for n, _ in sync][2:] == [n for n, _ in asyn][2:] == ["fence", "after"]


@pytest.mark.parametrize("how", ["positional", "keyword"])
async def test_fence_by_position_or_keyword_on_both_pools(how):
    for pool in _pools():
        rows = await _alloc(pool, 2)
        fs = FakeStream()
        fence = fs.record()
        if how == "positional":
            assert pool.free(rows, fence) == 0
        else:
            assert pool.free(rows, fence=fence) == 0
        assert pool.pending_size() == 2
        fs.complete()
        assert pool.reclaim() == 2
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


# ---------------------------------------------------------------- lease exit


async def test_lease_exit_raises_when_the_body_freed_a_row_and_frees_the_rest():
    async with AsyncReqToTokenPool(5, 4) as pool:
        with pytest.raises(DoubleFreeError, match=r"lease rows \[1\] were freed"):
            async with pool.lease(3) as rows:
                pool.free(rows[:1])  # not handed out again: exit still raises
        assert pool.allocated_size() == 0, "the rows the lease still owned leaked"
        assert_conserved(pool)


async def test_lease_exit_never_frees_another_owners_row():
    async with AsyncReqToTokenPool(2, 4) as pool:
        with pytest.raises(DoubleFreeError):
            async with pool.lease(1) as rows:
                pool.free(rows)
                other = await pool.alloc(1)
                assert other == rows  # the same row, another owner now
        assert pool.allocated_size() == 1 and pool.generation(other[0]) == 2
        pool.free(other)


async def test_lease_exit_after_a_clean_body_raises_nothing():
    async with AsyncReqToTokenPool(3, 4) as pool:
        async with pool.lease(2):
            pass
        assert pool.allocated_size() == 0


# ---------------------------------------------------------------- thread hand-off


def _in_thread(fn: Callable[[], Any], name: str) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["exc"] = exc

    th = threading.Thread(target=run, name=name)
    th.start()
    th.join(WAIT_S)
    assert not th.is_alive()
    if "exc" in box:
        raise box["exc"]
    return box.get("result")


def test_build_and_warm_in_one_thread_run_the_scheduler_in_another():
    pool = AsyncReqToTokenPool(5, 4)
    # Set-up outside any event loop: these calls do not bind the pool.
    warm = pool.try_alloc(4)
    assert warm == [1, 2, 3, 4]
    pool.free(warm)

    async def scheduler() -> list[int]:
        async with asyncio.timeout(WAIT_S):
            rows = await pool.alloc(2)
            waiter = asyncio.create_task(pool.alloc(3))
            await spin()
            pool.free(rows)
            got = await waiter
            pool.free(got)
            await pool.close()
            return got

    assert len(_in_thread(lambda: asyncio.run(scheduler()), "scheduler")) == 3


async def test_a_call_inside_a_running_loop_binds_and_names_both_threads():
    async with AsyncReqToTokenPool(5, 4) as pool:
        rows = pool.try_alloc(1)  # inside this loop: binds to this thread
        assert rows is not None
        with pytest.raises(WrongThreadError) as info:
            _in_thread(lambda: pool.free(rows), "intruder")
        msg = str(info.value)
        me = threading.current_thread()
        assert f"{me.name!r} (ident {me.ident})" in msg
        assert "'intruder' (ident " in msg and "pool.bind()" in msg
        pool.free(rows)


async def test_bind_hands_a_bound_pool_to_another_thread():
    pool = AsyncReqToTokenPool(5, 4)
    rows = await pool.alloc(2)  # bound to this thread and loop
    pool.free(rows)

    async def other_loop() -> list[int]:
        pool.bind()
        async with asyncio.timeout(WAIT_S):
            got = await pool.alloc(4)
            pool.free(got)
            return got

    assert _in_thread(lambda: asyncio.run(other_loop()), "new-owner") == [3, 4, 1, 2]
    with pytest.raises(WrongThreadError, match="'new-owner'"):
        pool.try_alloc(1)
    pool.bind()  # and back
    assert pool.try_alloc(1) == [3]
    await pool.close()


async def test_bind_without_a_loop_binds_the_thread_then_the_first_wait_binds_the_loop():
    pool = AsyncReqToTokenPool(3, 4)
    await pool.alloc(1)

    def handoff() -> list[int]:
        pool.bind()  # no loop running in this thread yet

        async def run() -> list[int]:
            async with asyncio.timeout(WAIT_S):
                held = await pool.alloc(1)
                waiter = asyncio.create_task(pool.alloc(1))  # waits: binds this loop
                await spin()
                pool.free(held)
                return await waiter

        return asyncio.run(run())

    assert _in_thread(handoff, "late-loop") == [2]


async def test_bind_is_refused_while_anyone_waits_or_a_row_is_pending():
    async with AsyncReqToTokenPool(3, 4) as pool:
        rows = await pool.alloc(2)
        waiter = asyncio.create_task(pool.alloc(1))
        await spin()
        before = pool_snapshot(pool)
        with pytest.raises(PoolBusyError, match="1 waiter queue"):
            _in_thread(pool.bind, "too-early")
        assert pool_snapshot(pool) == before
        fs = FakeStream()
        pool.free(rows[:1], fence=fs.record())
        pool.free(rows[1:])
        async with asyncio.timeout(WAIT_S):
            got = await waiter
        with pytest.raises(PoolBusyError, match="1 row wait behind fences"):
            _in_thread(pool.bind, "too-early")
        fs.complete()
        pool.reclaim()
        pool.free(got)
        pool.bind()  # nothing waits, nothing pending: allowed


# ---------------------------------------------------------------- resets


async def test_grants_in_one_loop_iteration_share_one_reset():
    async with AsyncReqToTokenPool(65, 4) as pool:
        rows = await pool.alloc(64)
        waiters = [asyncio.create_task(pool.alloc(1)) for _ in range(64)]
        await spin()
        pool.verified_lens[rows] = 7  # every row dirty
        resets = pool.stats().resets
        for row in rows:
            pool.free([row])  # 64 frees, 64 grants, one loop iteration
        async with asyncio.timeout(WAIT_S):
            got = await asyncio.gather(*waiters)
        assert pool.stats().resets - resets == 1
        assert all(pool.verified_lens[r[0]] == 0 for r in got)
        for r in got:
            pool.free(r)


async def test_grants_in_separate_iterations_each_reset_before_the_owner_resumes():
    """The documented cost: a reset runs before the new owner resumes, so
    grants made in different loop iterations cannot share one."""
    async with AsyncReqToTokenPool(9, 4) as pool:
        rows = await pool.alloc(8)
        seen: list[int] = []

        async def take() -> None:
            got = await pool.alloc(1)
            seen.append(int(pool.verified_lens[got[0]]))

        waiters = [asyncio.create_task(take()) for _ in range(8)]
        await spin()
        resets = pool.stats().resets
        for row in rows:
            pool.verified_lens[row] = 9
            pool.free([row])
            await asyncio.sleep(0)
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(*waiters)
        assert seen == [0] * 8
        assert pool.stats().resets - resets == 8


# ---------------------------------------------------------------- bytes per row


# Modules whose code runs on threads of the library's own (watchers, streams).
_THREADED = ("watcher.py", "fences.py", "fence_wait.py")


def _bookkeeping_bytes(size: int, rounds: int, batch: int) -> int:
    """Python bytes a pool holds after ``rounds`` of handing out every row,
    ``batch`` rows per alloc (tracemalloc: tensors are not counted)."""
    gc.collect()
    tracemalloc.start()
    try:
        pool = ReqToTokenPool(size, 4)
        for _ in range(rounds):
            for _ in range((size - 1) // batch):
                rows = pool.alloc(batch)
                assert rows is not None
                pool.free(rows)
        gc.collect()
        # The pool's own allocations only: tracemalloc counts every thread,
        # and a fence watcher or host stream left running by an earlier test
        # allocates in its own modules meanwhile.
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, f"*{os.sep}asyncpool{os.sep}{name}") for name in _THREADED]
        )
        used = sum(stat.size for stat in snapshot.statistics("filename"))
    finally:
        tracemalloc.stop()
    del pool
    return used


def test_bookkeeping_is_bounded_however_long_the_pool_runs():
    size = 257
    # Two rounds: every tag is then past CPython's cached small ints.
    batched_once = _bookkeeping_bytes(size, 2, size - 1)
    batched = _bookkeeping_bytes(size, 300, size - 1)
    single_once = _bookkeeping_bytes(size, 2, 1)
    single = _bookkeeping_bytes(size, 300, 1)
    # Nothing grows with the number of hand-outs.
    assert abs(batched - batched_once) < 512, (batched_once, batched)
    assert abs(single - single_once) < 512, (single_once, single)
    # A batch shares one generation tag; single-row hand-outs leave each
    # row a tag of its own (an int object, 32 B), and no more.
    assert single_once - batched_once <= 40 * (size - 1), (batched_once, single_once)


async def test_generations_change_on_every_hand_out_on_every_path():
    sync = ReqToTokenPool(2, 4)
    for i in range(1, 301):
        sync.free(sync.alloc(1))  # ledger take
        assert sync.generation(1) == i  # one row: its tag is the count
    assert sync.stats().allocs == 300
    async with AsyncReqToTokenPool(3, 4) as pool:
        led = pool._ledger
        last = {1: 0, 2: 0}
        for _ in range(300):
            [row] = await pool.alloc(1)  # inlined fast path, rows 1 and 2 alternate
            assert pool.generation(row) == led.granted > last[row]
            last[row] = pool.generation(row)
            pool.free([row])
        for _ in range(300):
            rows = await pool.alloc(2)  # ledger _pop, n > 1: one tag for the batch
            assert pool.generation(1) == pool.generation(2) == led.granted > max(last.values())
            last = {1: led.granted, 2: led.granted}
            pool.free(rows)
        held = await pool.alloc(2)
        assert held == [1, 2]
        waiter = asyncio.create_task(pool.alloc(1))
        await spin()
        pool.free([1])  # the grant loop's inlined take
        async with asyncio.timeout(WAIT_S):
            assert await waiter == [1]
        assert pool.generation(1) == led.granted == 300 + 600 + 2 + 1
        assert pool.generation(2) == 902
        assert pool.stats().allocs == 903
        pool.free([1, 2])


async def test_an_idle_pools_bulk_reset_zeroes_every_row_but_padding():
    async with AsyncReqToTokenPool(6, 4) as pool:
        calls: list[str] = []
        tables = pool._tables
        real = tables.reset_rows_from_1

        def spy() -> None:
            calls.append("from_1")
            real()

        tables.reset_rows_from_1 = spy  # type: ignore[method-assign]
        pool.verified_lens[0] = 3  # padding: never reset
        for _ in range(5):  # use up the clean rows, leaving each dirty
            rows = await pool.alloc(1)
            pool.verified_lens[rows[0]] = 7
            pool.alloced_lens[rows[0]] = 7
            pool.free(rows)
        rows = await pool.alloc(1)  # every row free and dirty: one zero_ op
        assert calls == ["from_1"]
        assert pool.verified_lens[1:].eq(0).all() and pool.alloced_lens[1:].eq(0).all()
        assert int(pool.verified_lens[0]) == 3
        for _ in range(4):  # the other rows dirty again, one row still held
            other = await pool.alloc(1)
            pool.verified_lens[other[0]] = 9
            pool.free(other)
        again = await pool.alloc(1)  # not idle: an index reset, row 0 untouched
        assert calls == ["from_1"]
        assert int(pool.verified_lens[again[0]]) == 0 and int(pool.verified_lens[0]) == 3
        pool.free(rows + again)
