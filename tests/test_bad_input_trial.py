"""Bad input found by a trial: each case gets a clear, typed error naming the
value and the rule, and leaves the pool (or stream) exactly as it was.

Pins: ``HostStream.launch``/``wait`` refuse what is not callable; 0-d meta
tensors and raising ``__index__`` give the typed error of any bad row id,
count or page id; unsigned slot tensors in ``set_req_pool_info``; ``after=``
objects that are not streams; the meta device, oversized sizes, unparsable
devices and a non-bool ``enable_memory_saver`` in the constructors; empty
float/bool tensors as rows or pages; ids of a dtype torch cannot read
(quantized, sub-byte: their ``tolist()``, ``item()`` and even ``repr()``
raise) as rows or pages; mappings as rows; ``priority=`` and
``max_waiters=`` of any integer type but bool; the strict ``query()`` answer
rule of ``is_done``; and ``force_release``'s log line.
"""

from __future__ import annotations

import array
import asyncio
import collections
import enum
import logging
import re
import types
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import WAIT_S, EventFence, bounded, kv_snapshot, pool_snapshot, spin

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    DeviceError,
    HostStream,
    InvalidSlotError,
    KVPagePool,
    PoolBusyError,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
)
from asyncpool.fences import is_done


def snapshot(pool: Any) -> tuple[Any, ...]:
    """Everything a raising call must leave unchanged: the row pool, its
    tables' lengths, and its page pool when it has one."""
    kv = getattr(pool, "kv", None)
    return (
        pool_snapshot(pool),
        pool.verified_lens.tolist(),
        pool.alloced_lens.tolist(),
        pool.req_to_token.sum().item(),
        kv_snapshot(kv) if kv is not None else None,
    )


# ---------------------------------------------------------------- 1. HostStream


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s: s.launch(None), id="launch-None"),
        pytest.param(lambda s: s.launch(42, 1), id="launch-int"),
        pytest.param(lambda s: s.wait(5), id="wait-int"),
        pytest.param(
            lambda s: s.wait(types.SimpleNamespace(synchronize=3)), id="wait-non-callable"
        ),
    ],
)
def test_stream_refuses_what_it_cannot_call(call: Any) -> None:
    with HostStream() as stream:
        before = (stream._queued, stream._done, stream._seq)
        with pytest.raises(TypeError, match=r"callable.*got (None|42|5|namespace)"):
            call(stream)
        assert (stream._queued, stream._done, stream._seq) == before
        # Not faulted: later work runs and later fences complete.
        ran: list[int] = []
        stream.launch(ran.append, 1)
        fence = stream.record()
        assert fence.wait(WAIT_S)
        assert stream.error is None and ran == [1]


# ------------------------------------------------- 2. meta scalars, bad __index__


class RaisingIndex:
    """An integer-like object whose ``__index__`` raises."""

    def __index__(self) -> int:
        raise RuntimeError("RaisingIndex cannot say its value")

    def __repr__(self) -> str:
        return "RaisingIndex()"


BAD_SCALARS: dict[str, Callable[[], Any]] = {
    "meta-0d": lambda: torch.tensor(3, device="meta"),
    "raising-index": RaisingIndex,
    # A dtype torch reads no scalar from, and cannot even print: item() and
    # repr() raise NotImplementedError (the error message must not).
    "bits8-0d": lambda: torch.tensor(3, dtype=torch.uint8).view(torch.bits8),
}
BAD_SCALAR_NAMED = r"meta|RaisingIndex|bits8"
EMPTY_INFO = ReqToTokenPoolInfo(0, 0, torch.zeros(0, dtype=torch.int32))


async def _lease(pool: AsyncReqToTokenPool, n: Any) -> None:
    async with pool.lease(n):
        raise AssertionError("a bad lease was granted")


# (id, call(pool, held row, fence, bad value)): coroutines are awaited.
SCALAR_CALLS: list[tuple[str, Callable[..., Any]]] = [
    ("free", lambda p, r, f, b: p.free(b)),
    ("free-list", lambda p, r, f, b: p.free([r, b])),
    ("record_use", lambda p, r, f, b: p.record_use(b, f)),
    ("record_use-list", lambda p, r, f, b: p.record_use([r, b], f)),
    ("generation", lambda p, r, f, b: p.generation(b)),
    ("set_req_pool_info", lambda p, r, f, b: p.set_req_pool_info(b, EMPTY_INFO)),
    ("try_alloc", lambda p, r, f, b: p.try_alloc(b)),
    ("try_admit", lambda p, r, f, b: p.try_admit(b)),
    ("extend-k", lambda p, r, f, b: p.extend(r, b)),
    ("extend-row", lambda p, r, f, b: p.extend(b, 1)),
    ("pages_of", lambda p, r, f, b: p.pages_of(b)),
    ("detach_pages", lambda p, r, f, b: p.detach_pages(b)),
    ("extend_rows-k", lambda p, r, f, b: p.extend_rows([r], k=b)),
    ("extend_rows-rows", lambda p, r, f, b: p.extend_rows([r, b], k=1)),
    ("alloc", lambda p, r, f, b: p.alloc(b)),
    ("lease", lambda p, r, f, b: _lease(p, b)),
    ("admit", lambda p, r, f, b: p.admit(b)),
    ("kv.alloc", lambda p, r, f, b: p.kv.alloc(b)),
    ("kv.free", lambda p, r, f, b: p.kv.free(b)),
    ("kv.free-list", lambda p, r, f, b: p.kv.free([b])),
]


@pytest.mark.parametrize("bad", BAD_SCALARS)
@pytest.mark.parametrize("call", [c for _, c in SCALAR_CALLS], ids=[i for i, _ in SCALAR_CALLS])
async def test_meta_scalar_or_raising_index_is_refused_typed(call: Any, bad: str) -> None:
    value = BAD_SCALARS[bad]()
    async with AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        grant = await pool.admit(pages=2)
        fence = EventFence()
        fence.set()
        before = snapshot(pool)
        with pytest.raises((InvalidSlotError, CapacityError)) as info:
            result = call(pool, grant.row, fence, value)
            if asyncio.iscoroutine(result):
                async with bounded():
                    await result
        assert re.search(BAD_SCALAR_NAMED, str(info.value)), info.value
        assert snapshot(pool) == before


@pytest.mark.parametrize("bad", BAD_SCALARS)
@pytest.mark.parametrize(
    "call",
    [
        lambda p, r, b: p.alloc(b),
        lambda p, r, b: p.free(b),
        lambda p, r, b: p.free([r, b]),
        lambda p, r, b: p.generation(b),
        lambda p, r, b: p.set_req_pool_info(b, EMPTY_INFO),
    ],
    ids=["alloc", "free", "free-list", "generation", "set_req_pool_info"],
)
def test_meta_scalar_or_raising_index_on_the_sync_pool(call: Any, bad: str) -> None:
    pool = ReqToTokenPool(10, 16)
    rows = pool.alloc(2)
    assert rows is not None
    before = snapshot(pool)
    with pytest.raises((InvalidSlotError, CapacityError), match=BAD_SCALAR_NAMED):
        call(pool, rows[0], BAD_SCALARS[bad]())
    assert snapshot(pool) == before


@pytest.mark.parametrize(
    "n",
    [torch.tensor([1, 2]), np.array([1, 2]), torch.tensor([1, 2], device="meta")],
    ids=["tensor-1d", "array-1d", "meta-1d"],
)
async def test_alloc_of_an_array_is_a_capacity_error(n: Any) -> None:
    # `n == 1` of an array has no truth value: alloc's fast-path test raised
    # torch's RuntimeError / numpy's ValueError instead of CapacityError.
    async with AsyncReqToTokenPool(9, 16) as pool:
        before = snapshot(pool)
        with pytest.raises(CapacityError, match="row count must be an integer"):
            await pool.alloc(n)
        assert snapshot(pool) == before


# ------------------------------------------------- 3. unsigned slot tensors

UNSIGNED = [torch.uint16, torch.uint32, torch.uint64]


@pytest.mark.parametrize("dtype", UNSIGNED, ids=str)
def test_set_req_pool_info_accepts_unsigned_slots(dtype: torch.dtype) -> None:
    pool = ReqToTokenPool(10, 16)
    (row,) = pool.alloc(1) or []
    slots = torch.tensor([7, 2**15 + 1, 0], dtype=dtype)
    pool.set_req_pool_info(row, ReqToTokenPoolInfo(2, 3, slots))
    assert pool.req_to_token[row, :4].tolist() == [7, 2**15 + 1, 0, 0]
    assert pool.alloced_lens_cpu[row] == 3 and pool.verified_lens[row] == 2


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.uint32, 2**31),
        (torch.uint32, 2**32 - 1),
        (torch.uint64, 2**40),
        (torch.uint64, 2**63 + 5),  # wraps negative in an int64 copy
        (torch.uint64, 2**64 - 1),
    ],
    ids=str,
)
def test_set_req_pool_info_refuses_unsigned_slots_that_do_not_fit(
    dtype: torch.dtype, value: int
) -> None:
    pool = ReqToTokenPool(10, 16)
    (row,) = pool.alloc(1) or []
    before = snapshot(pool)
    info = ReqToTokenPoolInfo(1, 2, torch.tensor([3, value], dtype=dtype))
    with pytest.raises(InvalidSlotError, match=rf"holds {value}, outside the token slot ids"):
        pool.set_req_pool_info(row, info)
    assert snapshot(pool) == before


# ------------------------------------------------- 4. after= that is not a stream

# Has a CUDA .device, as a CUDA tensor does, but is no stream: nothing to
# record an event on. Testable without CUDA.
NOT_A_STREAM = types.SimpleNamespace(device=torch.device("cuda"))


def _after_calls() -> list[Any]:
    return [
        pytest.param(lambda p, rows, pages: p.free(rows, after=NOT_A_STREAM), id="free"),
        pytest.param(
            lambda p, rows, pages: p.free(rows, EventFence(), after=NOT_A_STREAM),
            id="free-with-fence",
        ),
        pytest.param(lambda p, rows, pages: p.kv.free(pages, after=NOT_A_STREAM), id="kv.free"),
    ]


@pytest.mark.parametrize("call", _after_calls())
@pytest.mark.parametrize("with_kv", [False, True], ids=["rows", "kv"])
async def test_after_that_is_not_a_stream_is_refused(call: Any, with_kv: bool) -> None:
    kv = KVPagePool(17, 4)
    async with AsyncReqToTokenPool(9, 16, kv=kv if with_kv else None) as pool:
        rows = await pool.alloc(2)
        pages = kv.alloc(2)
        before = (snapshot(pool), kv_snapshot(kv))
        with pytest.raises(TypeError, match=r"after= must be a HostStream.*namespace"):
            call(pool if with_kv else types.SimpleNamespace(free=pool.free, kv=kv), rows, pages)
        assert (snapshot(pool), kv_snapshot(kv)) == before


def test_after_that_is_not_a_stream_on_the_sync_pool() -> None:
    pool = ReqToTokenPool(10, 16)
    rows = pool.alloc(2)
    before = snapshot(pool)
    with pytest.raises(TypeError, match=r"after= must be a HostStream.*namespace"):
        pool.free(rows, after=NOT_A_STREAM)
    assert snapshot(pool) == before


async def test_lease_with_an_after_that_is_not_a_stream_allocates_nothing() -> None:
    async with AsyncReqToTokenPool(9, 16) as pool:
        before = snapshot(pool)
        with pytest.raises(TypeError, match=r"after= must be a HostStream.*namespace"):
            pool.lease(2, after=NOT_A_STREAM)
        assert snapshot(pool) == before
        assert pool.stats().allocs == 0


# ------------------------------------------------- 5, 6. constructors

ROW_POOLS = [ReqToTokenPool, AsyncReqToTokenPool]
#: Each pool built on the device ``d``.
EVERY_POOL = pytest.mark.parametrize(
    "make",
    [
        lambda d: ReqToTokenPool(10, 16, device=d),
        lambda d: AsyncReqToTokenPool(10, 16, device=d),
        lambda d: KVPagePool(10, 4, device=d),
    ],
    ids=["ReqToTokenPool", "AsyncReqToTokenPool", "KVPagePool"],
)


@pytest.mark.parametrize("device", ["meta", torch.device("meta")], ids=["str", "device"])
@EVERY_POOL
def test_the_meta_device_is_refused(make: Any, device: Any) -> None:
    with pytest.raises(DeviceError, match=r"device=.*meta.* holds no data"):
        make(device)


@pytest.mark.parametrize(
    "device",
    ["10", "bogus", -1, None, 2.5],
    ids=repr,
)
@EVERY_POOL
def test_a_device_torch_cannot_use_is_a_device_error(make: Any, device: Any) -> None:
    with pytest.raises(DeviceError, match=rf"device={re.escape(repr(device))} is not a device"):
        make(device)


@pytest.mark.usefixtures("without_cuda")
@EVERY_POOL
def test_device_index_0_without_cuda_is_a_device_error(make: Any) -> None:
    # A CPU build refuses to parse 0 (no accelerator); on a GPU machine with
    # CUDA reported unavailable, 0 parses as cuda:0 and needs CUDA: either
    # way a DeviceError naming the value (run on both kinds of machine).
    with pytest.raises(DeviceError, match=r"device=0 (is not a device|needs CUDA)"):
        make(0)


@pytest.mark.usefixtures("without_cuda")
def test_page_pool_on_cuda_without_cuda_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="needs CUDA"):
        KVPagePool(10, 4, device="cuda")


@pytest.mark.parametrize("size", [10**30, 2**40, 2**31 + 1], ids=str)
@pytest.mark.parametrize("cls", ROW_POOLS)
def test_a_huge_row_pool_size_is_refused_up_front(cls: Any, size: int) -> None:
    # Refused before any table or ledger list is built (it filled a deque of
    # range(1, size) for minutes before failing).
    with pytest.raises(CapacityError, match=rf"size must be at most 2\*\*31 .*int32.*{size}"):
        cls(size, 16)


@pytest.mark.parametrize("cls", ROW_POOLS)
def test_a_huge_max_context_len_is_refused(cls: Any) -> None:
    with pytest.raises(ValueError, match=r"max_context_len must be at most 2\*\*31 - 1.*int32"):
        cls(4, 2**31)


@pytest.mark.parametrize("num_pages", [2**63, 10**30, 2**31 + 1], ids=str)
def test_a_huge_page_count_is_refused_up_front(num_pages: int) -> None:
    with pytest.raises(CapacityError, match=rf"num_pages must be at most 2\*\*31.*{num_pages}"):
        KVPagePool(num_pages, 4)


@pytest.mark.parametrize(
    ("num_pages", "page_size"), [(10, 2**63), (10, 2**30), (2**16, 2**15 + 1)], ids=str
)
def test_slot_ids_past_int32_are_refused(num_pages: int, page_size: int) -> None:
    # KVPagePool(10, 2**63) was accepted, then slots() overflowed.
    with pytest.raises(CapacityError, match=rf"page_size={page_size} .*int32.*2\*\*31"):
        KVPagePool(num_pages, page_size)


def test_the_largest_pool_whose_slot_ids_fit_int32_works() -> None:
    kv = KVPagePool(2**16, 2**15)  # num_pages * page_size == 2**31
    pages = kv.alloc(kv.capacity)
    assert pages is not None
    assert int(kv.slots(pages[-1:])[-1]) == 2**31 - 1


@pytest.mark.parametrize(
    "flag", [torch.tensor([1, 1]), torch.tensor(True), 1, "yes", None], ids=repr
)
@pytest.mark.parametrize("cls", ROW_POOLS)
def test_enable_memory_saver_must_be_a_bool(cls: Any, flag: Any) -> None:
    with pytest.raises(TypeError, match=r"enable_memory_saver must be a bool, got"):
        cls(4, 8, enable_memory_saver=flag)


# ------------------------------------------------- 7. empty tensors

# An empty tensor or array is no rows and no pages whatever its dtype:
# torch.tensor([]) is float32, and an engine's torch.tensor(finished_ids)
# with nothing finished must stay a no-op, as in the seed. Refusing it would
# protect nothing (there is no id to misread). Non-empty float or bool
# tensors stay refused (tests above).
EMPTY_FINE: dict[str, Callable[[], Any]] = {
    "list": list,
    "tuple": tuple,
    "torch-int64": lambda: torch.tensor([], dtype=torch.int64),
    "torch-uint8": lambda: torch.zeros(0, dtype=torch.uint8),
    "numpy-int32": lambda: np.array([], dtype=np.int32),
    "torch-float32": lambda: torch.tensor([]),
    "torch-bool": lambda: torch.tensor([], dtype=torch.bool),
    "numpy-float64": lambda: np.array([]),
}
# The calls that take a batch of rows or pages.
BATCH_CALLS: list[tuple[str, Callable[..., Any]]] = [
    ("free", lambda p, e: p.free(e)),
    ("free-fence", lambda p, e: p.free(e, EventFence())),
    ("record_use", lambda p, e: p.record_use(e, EventFence())),
    ("extend_rows", lambda p, e: p.extend_rows(e, k=1)),
    ("kv.free", lambda p, e: p.kv.free(e)),
    ("kv.free-fence", lambda p, e: p.kv.free(e, fence=EventFence())),
]


@pytest.mark.parametrize("empty", EMPTY_FINE)
@pytest.mark.parametrize("call", [c for _, c in BATCH_CALLS], ids=[i for i, _ in BATCH_CALLS])
async def test_an_empty_sequence_or_tensor_is_no_rows(call: Any, empty: str) -> None:
    async with AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        await pool.admit(pages=2)
        before = snapshot(pool)
        result = call(pool, EMPTY_FINE[empty]())
        if isinstance(result, torch.Tensor):
            assert result.numel() == 0  # extend_rows: a (0, k) tensor
        else:
            assert result in (None, 0)  # record_use: None; frees: 0 rows
        assert snapshot(pool) == before


# ------------------------------------------------- 8. mappings as rows

MAPPINGS: dict[str, Callable[[int], Any]] = {
    "dict": lambda r: {r: "x"},
    "mappingproxy": lambda r: types.MappingProxyType({r: "x"}),
}
MAPPING_CALLS: list[tuple[str, Callable[..., Any]]] = [
    ("free", lambda p, m: p.free(m)),
    ("free-fence", lambda p, m: p.free(m, EventFence())),
    ("record_use", lambda p, m: p.record_use(m, EventFence())),
    ("extend_rows", lambda p, m: p.extend_rows(m, k=1)),
]


@pytest.mark.parametrize("mapping", MAPPINGS)
@pytest.mark.parametrize(
    ("call", "with_kv"),
    [
        pytest.param(call, with_kv, id=f"{name}-{'kv' if with_kv else 'rows'}")
        for name, call in MAPPING_CALLS
        for with_kv in (False, True)
        if with_kv or name != "extend_rows"  # extend_rows needs kv=
    ],
)
async def test_a_mapping_of_rows_is_refused(call: Any, mapping: str, with_kv: bool) -> None:
    kv = KVPagePool(17, 4) if with_kv else None
    async with AsyncReqToTokenPool(9, 16, kv=kv) as pool:
        (row,) = await pool.alloc(1)
        before = snapshot(pool)
        with pytest.raises(InvalidSlotError, match=r"rows must be an int or a sequence of ints"):
            call(pool, MAPPINGS[mapping](row))
        assert snapshot(pool) == before


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_a_mapping_is_refused_by_the_sync_pool_and_the_page_pool(mapping: str) -> None:
    pool = ReqToTokenPool(10, 16)
    (row,) = pool.alloc(1) or []
    before = snapshot(pool)
    with pytest.raises(InvalidSlotError, match=r"rows must be an int or a sequence of ints"):
        pool.free(MAPPINGS[mapping](row))
    assert snapshot(pool) == before
    kv = KVPagePool(10, 4)
    pages = kv.alloc(1)
    assert pages is not None
    kv_before = kv_snapshot(kv)
    with pytest.raises(InvalidSlotError, match=r"pages must be .* sequence of ints"):
        kv.free(MAPPINGS[mapping](int(pages[0])))
    assert kv_snapshot(kv) == kv_before


def test_a_zero_tensor_is_refused_typed() -> None:
    """A ZeroTensor (``torch._efficientzerotensor``) is strided and of an
    integer dtype but has no storage: its read fails as bad input, not as a
    device fault (a review found torch's bare RuntimeError)."""
    zeros = torch._efficientzerotensor(3, dtype=torch.int64)
    pool = ReqToTokenPool(10, 16)
    assert pool.alloc(3) is not None
    before = snapshot(pool)
    with pytest.raises(InvalidSlotError):
        pool.free(zeros)
    with pytest.raises(InvalidSlotError):
        pool.record_use(zeros, EventFence())
    assert snapshot(pool) == before
    kv = KVPagePool(10, 4)
    assert kv.alloc(3) is not None
    kv_before = kv_snapshot(kv)
    with pytest.raises(InvalidSlotError):
        kv.free(zeros)
    assert kv_snapshot(kv) == kv_before


async def test_a_set_of_rows_is_accepted_as_kv_free_accepts_one() -> None:
    # Sets hold distinct ids, so nothing is freed twice; both paths take one.
    async with AsyncReqToTokenPool(9, 16) as pool:
        rows = await pool.alloc(3)
        assert pool.free(set(rows)) == 3
        assert pool.allocated_size() == 0
    kv = KVPagePool(10, 4)
    pages = kv.alloc(3)
    assert pages is not None
    assert kv.free(set(pages.tolist())) == 3


# ------------------------------------------------- 9. priority= and max_waiters=


class Prio(enum.IntEnum):
    NEG = -1
    HIGH = 0
    ONE = 1
    LOW = 5


INTEGER_FORMS: dict[str, Callable[[int], Any]] = {
    "int": int,
    "IntEnum": Prio,
    "numpy-int64": np.int64,
    "numpy-uint8": np.uint8,
    "torch-0d": torch.tensor,
}


async def _queued(pool: AsyncReqToTokenPool, order: list[str], name: str, call: Any) -> Any:
    async def run() -> None:
        got = await call()
        order.append(name)
        pool.free([got.row] if hasattr(got, "row") else got)

    task = asyncio.ensure_future(run())
    await spin()
    return task


@pytest.mark.parametrize("form", INTEGER_FORMS)
@pytest.mark.parametrize("admit", [False, True], ids=["alloc", "admit"])
async def test_priority_of_any_integer_type_queues_as_that_int(form: str, admit: bool) -> None:
    make = INTEGER_FORMS[form]
    async with AsyncReqToTokenPool(2, 4, kv=KVPagePool(5, 4) if admit else None) as pool:

        def call(p: Any) -> Any:
            return (
                (lambda: pool.admit(1, priority=p))
                if admit
                else (lambda: pool.alloc(1, priority=p))
            )

        held = await (pool.admit(1) if admit else pool.alloc(1))
        order: list[str] = []
        # One queue per priority value: A and C (same value, given as
        # different objects) are served FIFO around B of the same value, and
        # all three after the more urgent U.
        tasks = []
        try:
            for name, p in [("A", make(5)), ("B", 5), ("C", make(5)), ("U", make(0))]:
                tasks.append(await _queued(pool, order, name, call(p)))
            assert pool.waiting() == 4
            pool.free([held.row] if admit else held)
            async with bounded():
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert order == ["U", "A", "B", "C"]


@pytest.mark.parametrize(
    "priority",
    [True, np.bool_(False), torch.tensor(True), 1.0, torch.tensor(1.0), "1", None],
    ids=repr,
)
async def test_priority_that_is_not_an_integer_is_still_refused(priority: Any) -> None:
    async with AsyncReqToTokenPool(2, 4) as pool:
        await pool.alloc(1)
        before = snapshot(pool)
        with pytest.raises(TypeError, match=r"priority must be an int"):
            async with bounded():
                await pool.alloc(1, priority=priority)
        assert snapshot(pool) == before


@pytest.mark.parametrize("form", INTEGER_FORMS)
async def test_max_waiters_of_any_integer_type(form: str) -> None:
    value = INTEGER_FORMS[form](1)
    async with AsyncReqToTokenPool(2, 4, max_waiters=value) as pool:
        held = await pool.alloc(1)
        waiter = asyncio.ensure_future(pool.alloc(1))
        try:
            await spin()
            with pytest.raises(PoolBusyError, match="max_waiters=1;"):
                await pool.alloc(1)
            pool.free(held)
            async with bounded():
                pool.free(await waiter)
        finally:
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)


@pytest.mark.parametrize(
    "value", [True, np.bool_(True), -1, np.int64(-1), Prio.NEG, 1.0, "2"], ids=repr
)
def test_max_waiters_that_is_not_an_int_at_least_0_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"max_waiters must be None or an int >= 0"):
        AsyncReqToTokenPool(2, 4, max_waiters=value)


# ------------------------------------------------- 10. query() answers

YES_OR_NO: list[tuple[Any, bool]] = [
    (True, True),
    (False, False),
    (np.True_, True),
    (np.False_, False),
    (1, True),
    (0, False),
    (np.int64(1), True),
    (np.uint8(0), False),
    (Prio.ONE, True),
    (torch.tensor(True), True),
    (torch.tensor([0]), False),
    (torch.tensor(1, dtype=torch.int8), True),
    (np.array([True]), True),
    (np.array(0), False),
]
NOT_YES_OR_NO: list[Any] = [
    None,
    {},
    {"done": True},
    [0, 1],
    [1],
    (),
    2.0,
    1.0,
    0.0,
    np.float64(1.0),
    torch.tensor(2.0),
    torch.tensor(1.0),
    torch.tensor([1.0]),
    np.array([0.0]),
    torch.tensor([1, 1]),
    np.array([], dtype=bool),
    torch.tensor(2),
    torch.tensor(True, device="meta"),
]


@pytest.mark.parametrize(("answer", "want"), YES_OR_NO, ids=repr)
def test_is_done_takes_yes_or_no(answer: Any, want: bool) -> None:
    assert is_done(answer) is want


@pytest.mark.parametrize("answer", NOT_YES_OR_NO, ids=repr)
def test_is_done_refuses_everything_else(answer: Any) -> None:
    with pytest.raises(TypeError, match=r"not True or False|holds no value"):
        is_done(answer)


class AnswerFence:
    """A transfer handle whose ``query()`` answers what the test says."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)

    def query(self) -> Any:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("answer", NOT_YES_OR_NO, ids=repr)
@pytest.mark.parametrize("cls", ROW_POOLS)
async def test_rows_behind_an_answer_that_is_not_yes_or_no_are_quarantined(
    cls: Any, answer: Any
) -> None:
    # {} and None were "not done" (pending for ever), [0, 1], 2.0 and
    # tensor(2.0) "done" (freed at once, while the transfer may still write).
    pool = cls(10, 16)
    try:
        rows = await _alloc(pool, 3)
        assert pool.free(rows[:2], AnswerFence(answer)) == 0
        assert pool.quarantined_size() == 2
        assert pool.pending_size() == 0
        assert pool.allocated_size() == 1 and pool.available_size() == 6
        assert pool.stats().fence_errors == 1
        pool.check_invariants()
    finally:
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


@pytest.mark.parametrize("answer", [None, [0, 1], 2.0, torch.tensor(2.0)], ids=repr)
def test_rows_pending_behind_a_fence_that_later_answers_oddly_are_quarantined(
    answer: Any,
) -> None:
    pool = ReqToTokenPool(10, 16)
    rows = pool.alloc(2)
    assert rows is not None
    assert pool.free(rows, AnswerFence(False, answer)) == 0
    assert pool.pending_size() == 2
    assert pool.reclaim() == 0
    assert pool.quarantined_size() == 2 and pool.pending_size() == 0
    assert pool.available_size() == 7
    pool.check_invariants()


async def _alloc(pool: Any, n: int) -> list[int]:
    if isinstance(pool, AsyncReqToTokenPool):
        async with bounded():
            return await pool.alloc(n)
    rows = pool.alloc(n)
    assert rows is not None
    return list(rows)


# ------------------------------------------------- 11. force_release's log line


@pytest.mark.parametrize("with_kv", [False, True], ids=["rows", "kv"])
async def test_force_release_of_a_fence_only_recorded_as_a_use_says_what_it_dropped(
    with_kv: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")
    kv = KVPagePool(17, 4) if with_kv else None
    async with AsyncReqToTokenPool(9, 16, kv=kv) as pool:
        rows = [(await pool.admit(1)).row for _ in range(2)] if with_kv else await pool.alloc(2)
        fence = EventFence()  # never completes
        pool.record_use(rows, fence)
        assert pool.force_release(fence) == (0, 0)
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(msgs) == 1, msgs
        assert "dropped it from the recorded uses of 2 allocated rows" in msgs[0], msgs
        assert "nothing changed" not in msgs[0]
        # What it says happened: freed now, the rows do not wait for it.
        assert pool.free(rows) == 2
        # A fence that holds nothing and is no use either: nothing changed.
        caplog.clear()
        assert pool.force_release(fence) == (0, 0)
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(msgs) == 1 and "nothing changed" in msgs[0], msgs


class FaultedDeviceScalar:
    """A 0-d tensor on a device after a sticky fault: ``item()`` raises the
    device's error. That is not bad input: it must reach the engine as it
    is (an engine that recovers from a CUDA fault catches RuntimeError)."""

    ndim = 0
    is_meta = False

    def item(self) -> int:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_a_device_error_reading_a_row_id_is_not_turned_into_bad_input() -> None:
    async with AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        await pool.admit(pages=2)
        before = snapshot(pool)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            pool.free(FaultedDeviceScalar())
        with pytest.raises(RuntimeError, match="illegal memory access"):
            pool.free([1, FaultedDeviceScalar()])
        assert snapshot(pool) == before


# ------------------------------------------------- ids of a dtype torch cannot read


def _quantized_ids() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 1.0, 0, torch.quint8)


# 1-D tensors whose tolist() raises (RuntimeError) and, for the sub-byte
# dtypes, whose repr() raises too: before, free() let torch's RuntimeError or
# NotImplementedError out (from the error message's own repr, for the rows).
UNREADABLE_IDS: dict[str, Callable[[], torch.Tensor]] = {
    "quint8": _quantized_ids,
    "bits8": lambda: torch.tensor([1, 2], dtype=torch.uint8).view(torch.bits8),
    "uint4": lambda: torch.empty(2, dtype=torch.uint4),
}


@pytest.mark.parametrize("dtype", UNREADABLE_IDS)
@pytest.mark.parametrize("call", [c for _, c in BATCH_CALLS], ids=[i for i, _ in BATCH_CALLS])
async def test_ids_of_a_dtype_torch_cannot_read_are_refused_typed(call: Any, dtype: str) -> None:
    async with bounded(), AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        await pool.admit(pages=2)
        await pool.admit(pages=2)
        assert pool.kv.alloc(2) is not None  # pages the caller holds
        before = snapshot(pool)
        with pytest.raises(InvalidSlotError, match=rf"dtype torch\.{dtype}"):
            call(pool, UNREADABLE_IDS[dtype]())
        assert snapshot(pool) == before


# (make, snapshot) of the synchronous pools: each holds two ids from alloc(2).
SYNC_POOLS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "ReqToTokenPool": (lambda: ReqToTokenPool(10, 16), snapshot),
    "KVPagePool": (lambda: KVPagePool(10, 4), kv_snapshot),
}


@pytest.mark.parametrize("dtype", UNREADABLE_IDS)
@pytest.mark.parametrize("kind", SYNC_POOLS)
def test_ids_of_a_dtype_torch_cannot_read_on_the_sync_pools(kind: str, dtype: str) -> None:
    make, snap = SYNC_POOLS[kind]
    pool = make()
    assert pool.alloc(2) is not None
    before = snap(pool)
    with pytest.raises(InvalidSlotError, match=rf"dtype torch\.{dtype}"):
        pool.free(UNREADABLE_IDS[dtype]())
    assert snap(pool) == before


def test_an_empty_tensor_of_such_a_dtype_is_no_pages() -> None:
    """As for an empty float or bool tensor (no ids whatever the dtype)."""
    kv = KVPagePool(10, 4)
    assert kv.alloc(2) is not None
    before = kv_snapshot(kv)
    assert kv.free(torch.empty(0, dtype=torch.bits8)) == 0
    assert kv_snapshot(kv) == before


def _faulted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A tensor read on a device after a sticky fault."""
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_device_error_reading_a_few_page_ids_is_not_turned_into_bad_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A few page ids are read with ``tolist()``; on a device after a sticky
    fault that raises the device's RuntimeError, which must reach the engine
    as it is (as for a row id, above), not turn into ``InvalidSlotError`` or
    fall through to another way of reading the ids. Quantized and sub-byte
    dtypes raise RuntimeError there too: those are bad input (tested above)."""
    kv = KVPagePool(10, 4)
    pages = kv.alloc(2)
    assert pages is not None
    before = kv_snapshot(kv)
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", _faulted)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            kv.free(pages.clone())
    assert kv_snapshot(kv) == before


def _on_a_device(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    raise TypeError("can't convert cuda:0 device type tensor to numpy")


@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
@pytest.mark.parametrize(("name", "call"), BATCH_CALLS, ids=[i for i, _ in BATCH_CALLS])
async def test_a_device_error_reading_a_batch_of_ids_is_not_turned_into_bad_input(
    name: str, call: Any, many: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1-D integer tensor of rows or pages on a device after a sticky
    fault: ``tolist()`` (rows; a few pages) and ``.cpu()`` (many pages, after
    ``numpy()`` refuses a device tensor) raise the device's RuntimeError,
    which must reach the engine as it is, as for one row id (above), not
    become ``InvalidSlotError``. Meta, sparse, quantized and sub-byte tensors
    fail the same reads and stay bad input (tested above and in
    test_bad_input)."""
    n = 24 if many else 2  # pages past PageLedger's few-ids path (16) for "many"
    async with bounded(), AsyncReqToTokenPool(30, 16, kv=KVPagePool(2 * n + 2, 4)) as pool:
        rows = [(await pool.admit(pages=1)).row for _ in range(n)]
        held = pool.kv.alloc(n)  # pages the caller holds
        assert held is not None
        ids = held.clone() if name.startswith("kv.") else torch.tensor(rows)
        before = snapshot(pool)
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "tolist", _faulted)
            patch.setattr(torch.Tensor, "numpy", _on_a_device)
            patch.setattr(torch.Tensor, "cpu", _faulted)
            with pytest.raises(RuntimeError, match="illegal memory access"):
                call(pool, ids)
        assert snapshot(pool) == before


def test_the_ledger_names_the_same_integer_dtypes_the_tables_hold() -> None:
    """ledger.py tells a device fault from bad input by the dtype's printed
    name (it imports no torch); those names must be tables.ID_DTYPES'."""
    from asyncpool import ledger, tables

    assert {str(dtype) for dtype in tables.ID_DTYPES} == ledger.INTEGER_DTYPE_NAMES


# ------------------------------------------------- page counts torch cannot read

# One count per row, as extend_rows, extend_fitting and trim_pages take them.
UNREADABLE_COUNTS: dict[str, Callable[[], torch.Tensor]] = {
    **UNREADABLE_IDS,
    "meta": lambda: torch.ones(2, dtype=torch.int64, device="meta"),
    "sparse": lambda: torch.ones(2, dtype=torch.int64).to_sparse(),
}
COUNT_CALLS: dict[str, Callable[[Any, list[int], Any], Any]] = {
    "extend_rows": lambda pool, rows, k: pool.extend_rows(rows, k),
    "extend_fitting": lambda pool, rows, k: pool.extend_fitting(rows, k),
    "trim_pages": lambda pool, rows, k: pool.trim_pages(rows, k),
}


@pytest.mark.parametrize("form", UNREADABLE_COUNTS)
@pytest.mark.parametrize("call", COUNT_CALLS)
async def test_page_counts_in_a_tensor_torch_cannot_read_are_refused_typed(
    call: str, form: str
) -> None:
    # A trial found them raising torch's NotImplementedError or RuntimeError:
    # the rows were covered, 1-D counts were not.
    async with bounded(), AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        rows = [(await pool.admit(pages=2)).row for _ in range(2)]
        before = snapshot(pool)
        with pytest.raises(CapacityError, match=r"page counts in a tensor with data"):
            COUNT_CALLS[call](pool, rows, UNREADABLE_COUNTS[form]())
        assert snapshot(pool) == before


@pytest.mark.parametrize("call", COUNT_CALLS)
async def test_a_device_error_reading_page_counts_is_not_turned_into_bad_input(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with bounded(), AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        rows = [(await pool.admit(pages=2)).row for _ in range(2)]
        counts = torch.ones(2, dtype=torch.int64)
        before = snapshot(pool)
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "tolist", _faulted)
            with pytest.raises(RuntimeError, match="illegal memory access"):
                COUNT_CALLS[call](pool, rows, counts)
        assert snapshot(pool) == before


SET_FORMS: dict[str, Callable[[list[int]], Any]] = {
    "set": set,
    "frozenset": frozenset,
}
ORDERED_CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "extend_fitting": lambda pool, rows: pool.extend_fitting(rows, 1),
    "extend_fitting, counts": lambda pool, rows: pool.extend_fitting(rows, [1, 2]),
    "extend_rows, counts": lambda pool, rows: pool.extend_rows(rows, [1, 2]),
    "trim_pages, keeps": lambda pool, rows: pool.trim_pages(rows, [0, 1]),
}


@pytest.mark.parametrize("form", SET_FORMS)
@pytest.mark.parametrize("call", ORDERED_CALLS)
async def test_rows_in_a_set_are_refused_where_their_order_means_something(
    call: str, form: str
) -> None:
    # extend_fitting grows rows in the caller's order; per-row counts pair
    # with rows by position. A set has no order to pair by (a trial's find).
    async with bounded(), AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        rows = [(await pool.admit(pages=2)).row for _ in range(2)]
        before = snapshot(pool)
        with pytest.raises(InvalidSlotError, match=r"has none: give the rows as a list"):
            ORDERED_CALLS[call](pool, SET_FORMS[form](rows))
        assert snapshot(pool) == before


async def test_a_set_of_rows_still_does_where_order_means_nothing() -> None:
    async with bounded(), AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        rows = [(await pool.admit(pages=2)).row for _ in range(2)]
        assert pool.extend_rows(set(rows), 1) is not None  # one count for all
        assert pool.trim_pages(set(rows), 2) == 2  # one keep for all
        assert pool.trim_pages(set(rows), np.int64(1)) == 2
        assert pool.free(set(rows)) == 2


async def test_a_dicts_keys_keep_their_order_and_are_taken() -> None:
    # Insertion-ordered, unlike a set (a review's note).
    async with bounded(), AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        a, b = [(await pool.admit(pages=1)).row for _ in range(2)]
        m, got = pool.extend_fitting(dict.fromkeys([b, a]).keys(), [2, 1])
        assert m == 2 and pool.pages_of(b)[1:].tolist() == got[:2].tolist()
        assert pool.pages_of(a)[1:].tolist() == got[2:].tolist()
        pool.free([a, b])


COUNT_SEQUENCES: dict[str, Callable[[list[int]], Any]] = {
    "range": lambda counts: range(counts[0], counts[0] + len(counts)),
    "deque": collections.deque,
    "array.array": lambda counts: array.array("q", counts),
}


@pytest.mark.parametrize("form", COUNT_SEQUENCES)
async def test_per_row_counts_in_any_sequence_are_taken(form: str) -> None:
    # A range, deque or array.array of counts was read as one count and
    # refused with "a page count must be an integer" (a review's find).
    async with bounded(), AsyncReqToTokenPool(9, 16, kv=KVPagePool(33, 4)) as pool:
        rows = [(await pool.admit(pages=1)).row for _ in range(2)]
        counts = COUNT_SEQUENCES[form]([1, 2])
        got = pool.extend_rows(rows, counts)
        assert got is not None and got.shape == (3,)
        m, got = pool.extend_fitting(rows, COUNT_SEQUENCES[form]([1, 2]))
        assert m == 2 and got.shape == (3,)
        assert [len(pool.pages_of(r)) for r in rows] == [3, 5]
        assert pool.trim_pages(rows, COUNT_SEQUENCES[form]([1, 2])) == 2 + 3
        assert [len(pool.pages_of(r)) for r in rows] == [1, 2]
        with pytest.raises(CapacityError, match="lists 1 page counts for 2 rows"):
            pool.extend_rows(rows, COUNT_SEQUENCES[form]([1]))
        pool.free(rows)


def _nested(*rows: list[int]) -> torch.Tensor:
    with warnings.catch_warnings():  # nested tensors are a prototype in torch
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.tensor(r) for r in rows])


@pytest.mark.parametrize("call", [c for _, c in BATCH_CALLS], ids=[i for i, _ in BATCH_CALLS])
async def test_rows_in_a_nested_tensor_are_refused_typed(call: Any) -> None:
    # A review's find: the refusal of a 2-D tensor read its shape for the
    # message, which a nested tensor cannot give (torch's RuntimeError).
    async with bounded(), AsyncReqToTokenPool(9, 16, kv=KVPagePool(17, 4)) as pool:
        g = await pool.admit(pages=1)
        before = snapshot(pool)
        refused = r"got a (2-D|nested) <Tensor: dtype torch\.int64"
        with pytest.raises(InvalidSlotError, match=refused):
            call(pool, _nested([g.row], [g.row]))
        assert snapshot(pool) == before
