"""asyncpool: the request-slot pool of an LLM serving engine, for asyncio.

``await pool.alloc(n)`` waits in bounded, prioritised FIFO queues;
``pool.free(rows)`` defers each row behind the fences of the work that still
touches it, so a row freed under overlap scheduling is never reused before
the forward stream has run past every write to it.
"""

from __future__ import annotations

from .admission import Counts, QueueHead
from .errors import (
    AgreementError,
    CapacityError,
    DeviceError,
    DoubleFreeError,
    FenceError,
    InvalidSlotError,
    MemorySaverError,
    PoolBusyError,
    PoolClosedError,
    PoolError,
    WrongProcessError,
    WrongThreadError,
)
from .fence_wait import wait_fence
from .fences import (
    CudaFence,
    Fence,
    FenceAnswer,
    Fences,
    HostFence,
    HostStream,
    OrderedFence,
    new_stream_key,
    record_fence,
)
from .kv_pages import KVGroupStats, KVPagePool, KVPageStats
from .ledger import Rows
from .lifecycle import GrantHold
from .pool import AsyncReqToTokenPool, Lease
from .row_pages import Grant, GroupGrant
from .stats import Histogram, HistogramSnapshot, LatencySummary, PoolStats, PriorityStats
from .sync_pool import ReqToTokenPool
from .tables import PoolInfo, ReqToTokenPoolInfo

__all__ = [
    "AgreementError",
    "AsyncReqToTokenPool",
    "CapacityError",
    "Counts",
    "CudaFence",
    "DeviceError",
    "DoubleFreeError",
    "Fence",
    "FenceAnswer",
    "FenceError",
    "Fences",
    "Grant",
    "GrantHold",
    "GroupGrant",
    "Histogram",
    "HistogramSnapshot",
    "HostFence",
    "HostStream",
    "InvalidSlotError",
    "KVGroupStats",
    "KVPagePool",
    "KVPageStats",
    "LatencySummary",
    "Lease",
    "MemorySaverError",
    "OrderedFence",
    "PoolBusyError",
    "PoolClosedError",
    "PoolError",
    "PoolInfo",
    "PoolStats",
    "PriorityStats",
    "QueueHead",
    "ReqToTokenPool",
    "ReqToTokenPoolInfo",
    "Rows",
    "WrongProcessError",
    "WrongThreadError",
    "new_stream_key",
    "record_fence",
    "wait_fence",
]

__version__ = "0.1.0"
