"""An engine's typed integration, as mypy --strict sees it (mypy reads this
file, listed in pyproject's ``[tool.mypy] files``; pytest never collects it).

Each call here is accepted at run time (the input tests; a numpy or torch
integer wherever the docs take an int); each ``assert_type`` pins a
precise return type, so an ``Any`` leaking from the public API fails mypy.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple, assert_type

import numpy as np
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from asyncpool import (
    AgreementError,
    AsyncReqToTokenPool,
    CapacityError,
    Counts,
    DeviceError,
    DoubleFreeError,
    Fence,
    FenceAnswer,
    FenceError,
    Grant,
    GrantHold,
    GroupGrant,
    Histogram,
    HostStream,
    InvalidSlotError,
    KVGroupStats,
    KVPagePool,
    KVPageStats,
    Lease,
    MemorySaverError,
    OrderedFence,
    PoolBusyError,
    PoolClosedError,
    PoolError,
    PoolInfo,
    PoolStats,
    QueueHead,
    ReqToTokenPool,
    Rows,
    WrongThreadError,
    new_stream_key,
    record_fence,
    wait_fence,
)
from asyncpool.fences import is_done
from asyncpool.metrics import PoolCollector


class Transfer:
    """A KV transfer handle (NIXL, Mooncake style): a fence as it is."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CTransfer:
    """A transfer handle of a C extension, typed as its stub says: ``query()``
    answers 0 or 1 as an ``int`` (the pool reads the value: 1 is done, 0 is
    not, any other int a fault). A fence as it is (``FenceAnswer``)."""

    def query(self) -> int:
        return 1

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class StampedCTransfer:
    """An ordered fence whose ``query()`` answers a numpy bool."""

    stream_key: int
    seq: int

    def query(self) -> np.bool_:
        return np.True_

    def synchronize(self) -> None:
        pass


class StatusTransfer:
    """A handle whose ``query()`` answers a status word: no fence, by the
    annotation as at run time (a fault of the fence there)."""

    def query(self) -> str:
        return "DONE"

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class StampedTransfer:
    """An ordered fence of the engine's own stream, immutable."""

    stream_key: int
    seq: int

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class StreamPoint:
    """An ordered fence whose place is read through properties."""

    def __init__(self, key: int, seq: int) -> None:
        self._key, self._seq = key, seq

    @property
    def stream_key(self) -> int:
        return self._key

    @property
    def seq(self) -> int:
        return self._seq

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class EngineInfo:
    """The engine's own ReqToTokenPoolInfo (the seed's dataclass), frozen."""

    verified_len: int
    alloced_len: int
    alloced_slots: torch.Tensor


class TupleInfo(NamedTuple):
    verified_len: np.int64
    alloced_len: np.int64
    alloced_slots: torch.Tensor


class EnginePool(AsyncReqToTokenPool):
    """An engine's subclass: ``async with`` gives it back as itself."""


class Priority(enum.IntEnum):
    DECODE = 0
    PREFILL = 1


def build() -> tuple[AsyncReqToTokenPool, KVPagePool, ReqToTokenPool]:
    # Sizes from a config read with numpy or torch: integers of any type.
    kv = KVPagePool(np.int64(513), np.int32(16))
    forward = HostStream()  # or the engine's torch.cuda.Stream
    pool = AsyncReqToTokenPool(
        np.int64(65),
        torch.tensor(4096),
        stream=forward,
        kv=kv,
        max_waiters=np.int64(256),
        fence_timeout=30.0,
    )
    sync = ReqToTokenPool(np.int64(65), np.int64(4096))
    return pool, kv, sync


async def step(pool: AsyncReqToTokenPool, kv: KVPagePool, stream: HostStream) -> None:
    g = await pool.admit(pages=np.int64(3), priority=np.int64(Priority.PREFILL), timeout=1.0)
    assert_type(g, Grant)
    assert_type(g.row, int)
    assert_type(g.pages, torch.Tensor)
    assert_type(pool.try_admit(2), Grant | None)
    assert_type(await pool.alloc(1, priority=Priority.DECODE), list[int])
    assert_type(pool.try_alloc(np.int64(2)), list[int] | None)
    # A row id as the engine holds it: a tensor element, a numpy integer.
    req_pool_indices = torch.tensor([g.row])
    row = req_pool_indices[0]
    assert_type(pool.pages_of(row), torch.Tensor)
    assert_type(pool.extend(row, 1), torch.Tensor | None)
    assert_type(pool.extend_rows(req_pool_indices, 1), torch.Tensor | None)
    assert_type(pool.extend_fitting(req_pool_indices, 1), tuple[int, torch.Tensor])
    assert_type(pool.trim_pages(req_pool_indices, 1), int)
    assert_type(pool.drop_pages(req_pool_indices, np.array([0]), fence=[]), int)
    assert_type(pool.pages_dropped(row), int)
    slots = kv.slots(pool.pages_of(np.int64(g.row)))
    pool.set_req_pool_info(row, EngineInfo(0, int(slots.numel()), slots))
    pool.set_req_pool_info(np.int64(g.row), TupleInfo(np.int64(0), np.int64(0), slots[:0]))
    # Fences: the pool's own, a transfer handle, the engine's ordered ones.
    fence = record_fence(stream)
    assert_type(fence, OrderedFence)
    pool.record_use(req_pool_indices, fence)
    ordered: list[OrderedFence] = [
        stream.record(),
        StampedTransfer(new_stream_key(), 1),
        StreamPoint(new_stream_key(), 1),
        StampedCTransfer(new_stream_key(), 1),
    ]
    fences: list[Fence] = [Transfer(), CTransfer(), *ordered]
    answer: FenceAnswer = fences[1].query()
    assert is_done(answer)
    pool.record_use(req_pool_indices, [CTransfer(), StampedCTransfer(new_stream_key(), 2)])
    await wait_fence(CTransfer())
    await wait_fence(fences[0])
    assert_type(pool.detach_pages(row, host=True), torch.Tensor)
    assert_type(kv.free(pool.pages_of(row), fence=Transfer(), after=stream), int)
    assert_type(kv.free(pool.pages_of(row), fence=CTransfer()), int)
    assert_type(pool.free(req_pool_indices, fence=ordered[1]), int)
    assert_type(pool.force_release(ordered[2]), tuple[int, int])
    if torch.cuda.is_available():
        pool.free(req_pool_indices, after=torch.cuda.current_stream())
        kv.free(pool.pages_of(row), after=torch.Stream(device="cuda"))
    hold = pool.hold_grants(warn_after=5.0)
    assert_type(hold, GrantHold)
    hold.release()
    lease = pool.lease(np.int64(2), priority=np.int64(0), after=stream)
    assert_type(lease, Lease)
    async with lease as rows:
        assert_type(rows, list[int])
    async with pool as same:
        assert_type(same, AsyncReqToTokenPool)
    async with EnginePool(8, 16) as mine:
        assert_type(mine, EnginePool)


def mistakes(pool: AsyncReqToTokenPool, rows: list[int]) -> None:
    """Refused by the annotations as at run time (``TypeError``): the
    ``type: ignore`` fails mypy (``warn_unused_ignores``) should one pass."""
    pool.free(rows, after=Transfer())  # type: ignore[arg-type]  # a fence, not a stream
    pool.free(rows, fence=HostStream())  # type: ignore[arg-type]  # a stream, not a fence
    pool.free(rows, fence=StatusTransfer())  # type: ignore[arg-type]  # answers a str


def grow(pool: AsyncReqToTokenPool, rows: Rows, k: Counts) -> torch.Tensor | None:
    """An engine's wrapper names the argument types the pool exports."""
    return pool.extend_rows(rows, k)


def set_info(pool: AsyncReqToTokenPool, row: int, info: PoolInfo) -> None:
    pool.set_req_pool_info(row, info)


def observe(pool: AsyncReqToTokenPool, kv: KVPagePool, sync: ReqToTokenPool) -> None:
    assert_type(pool.stats(), PoolStats)
    assert_type(sync.stats(summaries=False), PoolStats)
    assert_type(kv.stats(), KVPageStats)
    assert_type(pool.stats().pages_pending, int)
    assert_type(pool.stats().kv_groups, Mapping[str, KVGroupStats])
    assert_type(pool.stats().kv_groups["swa"].growth_refusals, int)
    assert_type(pool.stats().kv_groups["swa"].free, int)
    assert_type(sync.alloc(np.int64(1)), list[int] | None)
    # Attributes a dashboard reads, declared where they are set (pyright
    # --verifytypes counts an attribute typed only by inference as ambiguous).
    assert_type(pool.kv, KVPagePool | None)
    assert_type(pool.req_to_token, torch.Tensor)
    assert_type(pool.max_context_len, int)
    assert_type(kv.page_size, int)
    assert_type(kv.num_pages, int)
    ledger = kv.ledger
    assert_type(ledger.capacity, int)
    assert_type(ledger.free_count, int)
    assert_type(ledger.peak_allocated, int)
    assert_type(ledger.pending, int)
    assert_type(ledger.quarantined, int)
    assert_type(ledger.deferred_frees, int)
    assert_type(ledger.reclaimed, int)
    assert_type(ledger.fence_errors, int)
    assert_type(ledger.explicit, bool)
    assert_type(ledger.fence_histogram, Histogram)
    collector = PoolCollector(pool, name="decode")
    collector.add(sync, name="sync")
    CollectorRegistry().register(collector)
    assert_type(collector.collect(), Iterator[Metric])
    assert_type(collector.describe(), list[Metric])
    with HostStream() as stream:
        assert_type(stream, HostStream)
    errors: tuple[type[PoolError], ...] = (
        CapacityError,
        InvalidSlotError,
        DoubleFreeError,
        PoolClosedError,
        PoolBusyError,
        FenceError,
        WrongThreadError,
        MemorySaverError,
        DeviceError,
        AgreementError,
    )
    del errors


async def hybrid_step() -> None:
    """A hybrid model's pool: KV groups (sliding window, full attention and a
    Mamba state slot), admitted with the row in one await."""
    groups: dict[str, KVPagePool] = {
        "swa": KVPagePool(1025, 16),
        "full": KVPagePool(4097, 16),
        "mamba": KVPagePool(65, 1),
    }
    pool = AsyncReqToTokenPool(65, 4096, kv=groups)
    assert_type(pool.kv_groups, Mapping[str, KVPagePool] | None)
    g = await pool.admit({"swa": 4, "full": np.int64(8), "mamba": 1}, priority=1, timeout=1.0)
    assert_type(g, GroupGrant)
    row, pages = g
    assert_type(row, int)
    assert_type(pages, dict[str, torch.Tensor])
    assert_type(pool.try_admit({"swa": 1, "full": 1, "mamba": 1}), GroupGrant | None)
    assert_type(pool.extend(row, 1, group="full"), torch.Tensor | None)
    assert_type(pool.extend_rows([row], 1, group="swa"), torch.Tensor | None)
    assert_type(pool.extend_fitting([row], 1, group="swa"), tuple[int, torch.Tensor])
    assert_type(pool.trim_pages([row], 2, group="swa"), int)
    assert_type(pool.drop_pages([row], 1, group="swa"), int)
    assert_type(pool.pages_dropped(row, group="swa"), int)
    assert_type(pool.pages_of(row, group="mamba"), torch.Tensor)
    assert_type(pool.detach_pages(row, group="full"), torch.Tensor)
    assert_type(pool.pages_short(group="full"), int)
    head = pool.queue_head()
    assert_type(head, QueueHead | None)
    if head is not None:
        assert_type(head.call, Literal["alloc", "admit"])
        assert_type(head.pages_short, int | Mapping[str, int])
        assert_type(head.waited_s, float)
    pool.free(row)
