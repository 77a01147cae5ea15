"""``set_req_pool_info`` takes the engine's own ``ReqToTokenPoolInfo``.

A drop-in swaps the pool class, not the engine's dataclass: the seed's
``ReqToTokenPoolInfo`` (same three fields) is written as asyncpool's own
is. An object without the fields is refused with an error that names its
module and class (it named "ReqToTokenPoolInfo" twice for the seed's
class), writing nothing. (Found by a drop-in trial.)
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from helpers import pool_snapshot

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, ReqToTokenPool


@dataclasses.dataclass
class ReqToTokenPoolInfo:  # the seed's dataclass, as an engine defines it
    verified_len: int
    alloced_len: int
    alloced_slots: torch.Tensor


def test_the_seed_dataclass_is_written() -> None:
    pool = ReqToTokenPool(4, 8, device="cpu", enable_memory_saver=False)
    (row,) = pool.alloc(1) or []
    pool.set_req_pool_info(row, ReqToTokenPoolInfo(1, 2, torch.tensor([5, 6])))  # type: ignore[arg-type]
    assert pool.verified_lens[row].item() == 1 and pool.alloced_lens[row].item() == 2
    assert pool.req_to_token[row, :2].tolist() == [5, 6]


async def test_the_seed_dataclass_is_written_on_the_async_pool() -> None:
    pool = AsyncReqToTokenPool(4, 8)
    (row,) = await pool.alloc(1)
    pool.set_req_pool_info(row, ReqToTokenPoolInfo(2, 3, torch.tensor([7, 8, 9])))  # type: ignore[arg-type]
    assert pool.req_to_token[row, :3].tolist() == [7, 8, 9]
    assert pool.alloced_lens_cpu[row].item() == 3


def test_an_object_without_the_fields_is_refused_by_name() -> None:
    pool = ReqToTokenPool(4, 8, device="cpu", enable_memory_saver=False)
    (row,) = pool.alloc(1) or []
    before = pool_snapshot(pool)
    tables = pool.req_to_token.clone(), pool.verified_lens.clone(), pool.alloced_lens.clone()
    info = types.SimpleNamespace(verified_len=1, alloced_len=1)  # no alloced_slots
    with pytest.raises(InvalidSlotError, match=r"alloced_slots.*types\.SimpleNamespace"):
        pool.set_req_pool_info(row, info)  # type: ignore[arg-type]
    assert pool_snapshot(pool) == before
    after = pool.req_to_token, pool.verified_lens, pool.alloced_lens
    assert all(torch.equal(a, b) for a, b in zip(tables, after, strict=True))
