"""``record_use(rows, None)`` is a ``TypeError``, changing nothing.

Found by a trial that ported an SGLang-shaped scheduler: ``fence=None`` is
"no fence" on a free (its default), and ``record_use`` read it the same way,
so a step whose fence variable was still None recorded nothing and its rows
(and their pages) went back at the next free while the step still ran. The
docstrings said ``TypeError`` for a fence that is not a fence, as
``force_release(None)`` and ``wait_fence(None)`` raise. ``[]`` stays the
documented way to record no fence.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from helpers import WAIT_S, kv_snapshot, pool_snapshot

from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool, ReqToTokenPool


def _snapshot(pool: Any) -> tuple[Any, ...]:
    kv = getattr(pool, "kv", None)
    return (pool_snapshot(pool), kv_snapshot(kv) if kv is not None else None)


@pytest.mark.parametrize("with_kv", [False, True], ids=["rows", "kv"])
@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
async def test_record_use_of_none_is_refused_and_changes_nothing(
    with_kv: bool, reclaim: str
) -> None:
    kv = KVPagePool(16, 4) if with_kv else None
    pool = AsyncReqToTokenPool(8, 32, kv=kv, reclaim=reclaim)
    if with_kv:
        rows = [(await pool.admit(pages=2)).row for _ in range(2)]
    else:
        rows = await pool.alloc(2)
    before = _snapshot(pool)
    with pytest.raises(TypeError, match=r"record_use\(\) needs the fence .* got None"):
        pool.record_use(rows, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got None"):
        pool.record_use(rows[0], None)  # type: ignore[arg-type]
    assert _snapshot(pool) == before
    pool.record_use(rows, [])  # the documented "no fence"
    assert _snapshot(pool) == before
    assert pool.free(rows) == 2  # nothing was recorded: free at once
    await pool.close()


async def test_a_step_recorded_with_none_still_holds_its_rows_afterwards() -> None:
    """The refused call leaves the step's earlier record in place: the rows
    stay pending behind the fence recorded before."""
    stream = HostStream()
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(8, 2))
    grant = await pool.admit(pages=2)
    release = threading.Event()
    stream.launch(release.wait, WAIT_S)
    fence = stream.record()
    pool.record_use([grant.row], fence)
    with pytest.raises(TypeError):
        pool.record_use([grant.row], None)  # type: ignore[arg-type]
    assert pool.free([grant.row]) == 0  # pending behind the first fence
    assert pool.pending_size() == 1
    assert pool.kv is not None and pool.kv.pending_size() == 2
    release.set()
    stream.synchronize()
    stream.close()
    await pool.close()


def test_sync_pool_record_use_of_none_is_refused() -> None:
    pool = ReqToTokenPool(4, 8)
    rows = pool.alloc(2)
    assert rows is not None
    before = _snapshot(pool)
    with pytest.raises(TypeError, match="got None"):
        pool.record_use(rows, None)  # type: ignore[arg-type]
    assert _snapshot(pool) == before
    assert pool.free(rows) == 2
