"""``alloc`` and ``lease`` refuse a row count that is an array or a tensor of
several (or no) elements with :class:`CapacityError`, as ``try_alloc`` does,
and change nothing. ``alloc``'s inlined single-row path compared ``n == 1``
before it checked the type, so numpy and torch raised their own "truth value
is ambiguous" errors instead. (Found by a bad-input trial.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import pool_snapshot

from asyncpool import AsyncReqToTokenPool, CapacityError

COUNTS: list[Any] = [
    np.array([2, 3]),
    np.array([1, 1]),
    torch.tensor([1, 1]),
    torch.tensor([], dtype=torch.int64),
    np.array([], dtype=np.int64),
]


@pytest.mark.parametrize("n", COUNTS, ids=lambda n: f"{type(n).__name__}{list(n.shape)}")
async def test_alloc_and_lease_refuse_array_counts(n: Any) -> None:
    pool = AsyncReqToTokenPool(10, 16)
    held = await pool.alloc(2)
    before = pool_snapshot(pool)
    with pytest.raises(CapacityError, match="row count"):
        await pool.alloc(n)
    with pytest.raises(CapacityError, match="row count"):
        async with pool.lease(n):
            pass
    with pytest.raises(CapacityError, match="row count"):
        pool.try_alloc(n)
    assert pool_snapshot(pool) == before
    pool.free(held)
    pool.check_invariants()
