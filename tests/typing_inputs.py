"""What engines hold type-checks where the pool takes rows (mypy reads this
file, listed in pyproject's ``[tool.mypy] files``; pytest never collects it).

Ints, integer scalars and 1-D integer tensors and arrays are accepted at run
time (``tests/test_inputs_and_handoff.py``) and by the annotation
(``asyncpool.ledger.Rows``); a float is refused by both: the ``type:
ignore`` below fails mypy (``warn_unused_ignores``) should the annotation
ever accept one.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncpool import AsyncReqToTokenPool, HostFence, HostStream, KVPagePool, ReqToTokenPool


def rows_as_engines_hold_them(
    pool: AsyncReqToTokenPool, sync: ReqToTokenPool, stream: HostStream
) -> None:
    pool.free([1, 2])
    pool.free(np.int64(3))
    pool.free(torch.tensor(4))
    pool.free(torch.tensor([1, 2]))
    pool.free(np.array([1, 2]))
    pool.record_use(torch.tensor([1]), stream.record())
    pool.extend_rows(torch.tensor([1, 2]), 1)
    sync.free(np.array([5]))
    pool.free(1.5)  # type: ignore[arg-type]


async def counts_as_engines_hold_them(
    pool: AsyncReqToTokenPool, sync: ReqToTokenPool, kv: KVPagePool
) -> None:
    """Counts and a row id as integer scalars: accepted at run time (the
    input tests) and by the annotations (``SupportsIndex``)."""
    await pool.alloc(np.int64(1))
    pool.try_alloc(np.int64(1))
    await pool.admit(np.int64(2))
    pool.try_admit(torch.tensor(2))
    pool.extend(np.int64(1), np.int64(1))
    pool.extend_rows([1, 2], [np.int64(1), 2])
    pool.trim_pages([1], np.int64(1))
    kv.alloc(np.int32(2))
    sync.alloc(np.int64(1))
    await pool.admit(2.0)  # type: ignore[call-overload]


def fences_as_engines_pass_them(
    pool: AsyncReqToTokenPool, sync: ReqToTokenPool, kv: KVPagePool, stream: HostStream
) -> None:
    """Several fences as a list or tuple (``asyncpool.Fences``), including a
    list typed by its fences' own class (a sequence, so covariant); a set is
    refused by the annotation as at run time."""
    fences: list[HostFence] = [stream.record(), stream.record()]
    pool.free([1], fences)
    pool.free([1], fence=(stream.record(), stream.record()))
    pool.record_use([1], fences)
    pool.trim_pages([1], 1, fences)
    sync.free([1], fences)
    sync.record_use([1], [])
    kv.free(torch.tensor([1]), fence=fences)
    pool.free([1], set(fences))  # type: ignore[arg-type]


def pages_as_engines_hold_them(kv: KVPagePool, pages: torch.Tensor) -> None:
    """``kv.free`` takes what the row calls take (``asyncpool.Rows``): the
    tensor ``alloc`` gave, a list, a numpy array, one id, an iterable of
    ids; accepted at run time (``tests/test_kv_pages.py``). A float and a
    string are refused by both (the annotation was ``object``)."""
    kv.free(pages)
    kv.free([1, 2])
    kv.free((1, np.int64(2)))
    kv.free(np.array([1, 2]))
    kv.free(np.int64(3))
    kv.free(3)
    kv.free(range(1, 3))
    kv.free(1.5)  # type: ignore[arg-type]
    kv.free("1")  # type: ignore[arg-type]


def slots_of_pages_as_engines_hold_them(kv: KVPagePool, pages: torch.Tensor) -> None:
    """``kv.slots`` takes pages as ``kv.free`` does (``asyncpool.Rows``):
    accepted at run time (``tests/test_kv_pages.py``). A float and a string
    are refused by both (the annotation was ``object``: these ignores would
    be unused, which fails mypy)."""
    kv.slots(pages)
    kv.slots([1, 2])
    kv.slots(np.array([1, 2], dtype=np.int32))
    kv.slots(np.int64(3))
    kv.slots(7)
    kv.slots(range(1, 3))
    kv.slots(1.5)  # type: ignore[arg-type]
    kv.slots("1")  # type: ignore[arg-type]
